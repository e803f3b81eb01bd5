"""The OpenAI-compatible server: protocol.py (request and error bodies), server.py (the FastAPI app)."""
