"""The OpenAI-compatible server: `tandem serve` (FastAPI + uvicorn over one engine-loop thread)."""
