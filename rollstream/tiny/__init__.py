"""Tiny models built offline for tests, the demo and benchmarks: a text model with its
tokenizer (``text_model``) and a Qwen2-VL-style VLM with its processor (``vlm``)."""
