# SPDX-License-Identifier: Apache-2.0
"""What both backends read, with no model and no device in it: checkpoint resolution (folders, cached hub ids, GGUF
converted once) and tokenizers (checkpoint.py), safetensors read tensor by tensor (safetensors_index.py), the model's
shape from config.json (model_shape.py: ModelShape, not TT-Transformers' ModelArgs), rotary tables (rope.py), EAGLE-3
draft heads' layouts and files (eagle3_format.py), and the cache root every cache lives under (cache.py)."""
