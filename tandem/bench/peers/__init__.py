"""Peers (HF transformers, llama.cpp, onnxruntime-genai, vLLM, TRL) next to tandem in one run, each in its own worker where it needs its own venv."""
