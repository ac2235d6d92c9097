# SPDX-License-Identifier: Apache-2.0
"""The model's shape (hyper-parameters) read from a Hugging Face `config.json` (Llama and Mistral families):
ModelShape, which both backends read; TT-Transformers' own ModelArgs is another thing (ttnn_backend/model.py)."""
from dataclasses import dataclass
from typing import Optional

from ..errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral")


class ModelConfigError(UserError):
    """A checkpoint's config.json describes a model this backend cannot run."""


@dataclass(frozen=True)
class ModelShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    tie_word_embeddings: bool
    sliding_window: Optional[int]
    max_position_embeddings: int
    model_type: str

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelShape":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported; this backend runs {', '.join(SUPPORTED_MODEL_TYPES)} "
                "checkpoints. Point HF_MODEL/--model at a Llama or Mistral checkpoint folder."
            )
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ModelConfigError(f"{flag}=true is not supported by this Llama/Mistral backend")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        # transformers >= 5 moved rope_theta/rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ModelConfigError(f"rope_type {rope_type!r} is not supported (default, linear, llama3)")
        n_heads = cfg["num_attention_heads"]
        dim = cfg["hidden_size"]
        sliding_window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or dim // n_heads,
            hidden_dim=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=sliding_window,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            model_type=model_type,
        )

    def weight_bytes_per_token(self, n_layers: int, bytes_per_param: int) -> int:
        """Bytes of weights a one-token decode reads (embedding row excluded): the bandwidth floor's numerator."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.hidden_dim
        norms = 2 * self.dim
        return bytes_per_param * (n_layers * (attn + mlp + norms) + self.dim + self.vocab_size * self.dim)
