"""Serving: the engine thread that batches requests (each row its own KV cache and
routing state) and the HTTP layer (OpenAI's and mlx_lm.server's API, Anthropic's,
Ollama's) over it: edgemoe.serving.app puts them together."""
