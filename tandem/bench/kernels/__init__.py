"""Kernels: forward speed, k-token costs and the roofline on CPU and GPU, and thread hand-off costs."""
