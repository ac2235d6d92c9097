# SPDX-License-Identifier: Apache-2.0
"""What this package's models declare to vllm-tt-plugin, and the K they serve at a concurrency.

The verify gives every candidate token its own decode row, and on TT every row of every request shares the decode
batch's one 32-row tile (ttnn_backend.model.TILE_ROWS): a plan fits max_num_seqs * (1 + K) <= 32, so speculation and
32-way concurrency exclude each other. Past the tile the answer is a SpecReject naming the K that fit, not a
silently smaller K: the operator sees what was asked for and what can be served.
"""
from typing import Optional

from .contract import (
    ACCEPT_MODE_ARGMAX_IDS,
    DRAFTER_STATE_INTERNAL,
    MODEL_OWNED_DRAFTER,
    SPEC_REQUIREMENT_DEVICE_PROPOSE,
    SpecPlan,
    SpecReject,
)

VERIFY_TILE_ROWS = 32  # the TT decode tile every verify row shares (ttnn_backend.model.TILE_ROWS)
MAX_PLAN_K = 64  # speculative.backend.MAX_DRAFT_TOKENS: the most drafts a backend sizes a verify for

# model_capabilities entries a speculating model adds. The drafter is the model's own (custom_class with the
# vllm_tt_plugin.model_owned_drafter sentinel needs device_propose), reads the committed block only (no hidden feed,
# so no handoff), and commits one token per ordinary step.
SPEC_CAPABILITIES = {
    "supports_spec_decode": True,
    "spec_requirements": [SPEC_REQUIREMENT_DEVICE_PROPOSE],
    "spec_hidden_handoff": [],
    "output_tokens_per_step": 1,
}


def drafter_refusal(vllm_config) -> Optional[str]:
    """Why the launch's speculative method cannot run on this model's drafter, in one line naming the fix; None when
    it can (or the launch does not speculate). The drafter learns each request's tokens from the committed blocks
    propose_draft_tokens brings, and the plugin calls it only for custom_class with the model-owned-drafter sentinel:
    under ngram (which the plugin also admits for a device_propose model) it never does, and the first decode after
    a prefill leaves the drafter's requests behind."""
    spec_config = getattr(vllm_config, "speculative_config", None)
    if spec_config is None:
        return None
    method, model = getattr(spec_config, "method", None), getattr(spec_config, "model", None)
    if str(method) == "custom_class" and model == MODEL_OWNED_DRAFTER:
        return None
    return (f"speculative method {method!r} (model {model!r}) is not served by this model, whose drafter is its own: "
            f"launch with --speculative-config '{{\"method\": \"custom_class\", \"model\": \"{MODEL_OWNED_DRAFTER}\", "
            f"\"num_speculative_tokens\": K}}'")


def tt_data_parallel_size(vllm_config) -> int:
    """The TT data-parallel lanes a launch asks for, read from its vLLM config as the plugin reads it
    (vllm-tt-plugin src/vllm_tt_plugin/config.py, get_tt_config and get_tt_data_parallel_size, versions differ): the
    user's `--additional-config '{"tt": {"tt_data_parallel_size": N}}'` (or the deprecated plugin_config's "tt"), and
    the lane count the plugin resolved for a Galaxy (additional_config["_tt_resolved_lane_count"]); 1 when neither is
    set. vLLM's own data_parallel_size is not: each such rank is an engine with its own mesh and model."""
    sizes = [1]
    for name in ("additional_config", "plugin_config"):
        config = getattr(vllm_config, name, None) or {}
        if isinstance(config, dict):
            tt = config.get("tt") if isinstance(config.get("tt"), dict) else {}
            sizes += [value for value in (tt.get("tt_data_parallel_size"), config.get("_tt_resolved_lane_count"))
                      if is_count(value)]
    return max(sizes)


def tt_layout_refusal(vllm_config, num_devices: Optional[int] = None, tt_data_parallel: Optional[int] = None):
    """Why a speculative launch cannot run on this TT layout, in one line naming the fix; None when it can. At
    configuration time (spec_plan: the plugin's vllm_config carries no TT platform state) the layout is the mesh
    MESH_DEVICE names (TG and BHGLX are 8 x 4 Galaxies; the plugin opens the mesh it names) and the launch's TT
    data-parallel size (tt_data_parallel_size); when the model loads, also the mesh TT builds on (num_devices: 32 on a
    Galaxy, as TT's Attention tells one, `self.TG = self.num_devices == 32`) and initialize_vllm_model's
    tt_data_parallel."""
    import os

    from ..ttnn_backend.device import MESH_SHAPES

    if MESH_SHAPES.get(os.environ.get("MESH_DEVICE", "")) == (8, 4) or num_devices == 32:
        return ("speculative decoding on a Galaxy is not served yet: there a verify step's rows must stay in one mesh "
                "column's 8 users (ttnn_backend/causal_lm.py, max_step_rows), and this class verifies on the whole "
                "32-row tile; launch without --speculative-config")
    lanes = max(tt_data_parallel_size(vllm_config), tt_data_parallel if is_count(tt_data_parallel) else 1)
    if lanes > 1:
        return (f"speculative decoding serves one TT-Transformers model per engine: tt_data_parallel {lanes} is not "
                "supported with a speculative config; launch with tt_data_parallel_size 1 (vLLM's "
                "--data-parallel-size runs one engine per rank) or without --speculative-config")
    return None


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plan_speculation(vllm_config, max_num_seqs, requested_k, tile_rows: int = VERIFY_TILE_ROWS):
    """The contract's spec_plan: a SpecPlan for (max_num_seqs, requested_k), or a SpecReject with the K that fit.
    Never raises. vllm_config is read for the speculative method (drafter_refusal) and max_model_len (it carries no TT
    platform state at this point)."""
    refusal = drafter_refusal(vllm_config)
    if refusal is not None:
        return SpecReject(refusal)
    if not is_count(max_num_seqs) or max_num_seqs < 1:
        return SpecReject(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
    k_max = min(tile_rows // max_num_seqs - 1, MAX_PLAN_K)
    max_model_len = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    if is_count(max_model_len):
        k_max = min(k_max, max_model_len - 1)  # a block of 1 + K positions must fit the context
    supported = tuple(range(1, k_max + 1))
    if not is_count(requested_k) or requested_k < 1:
        return SpecReject(f"num_speculative_tokens must be a positive integer, got {requested_k!r}", supported)
    if k_max < 1:
        return SpecReject(f"num_speculative_tokens {requested_k} with max_num_seqs {max_num_seqs}: no K fits, every "
                          f"verify row of every request shares one {tile_rows}-row decode tile (max_num_seqs * (1 + K) "
                          f"<= {tile_rows}); lower --max-num-seqs to {tile_rows // 2} or less to speculate")
    if requested_k > k_max:
        return SpecReject(f"num_speculative_tokens {requested_k} with max_num_seqs {max_num_seqs} needs "
                          f"{max_num_seqs} x (1 + {requested_k}) verify rows, past the {tile_rows}-row decode tile"
                          + (f" or max_model_len {max_model_len}" if is_count(max_model_len) else "")
                          + f": ask for num_speculative_tokens <= {k_max}", supported)
    return SpecPlan(effective_k=requested_k, lanes_per_request=1 + requested_k, extra_bytes_per_seq=0,
                    extra_bytes_per_token=0, accept_modes=(ACCEPT_MODE_ARGMAX_IDS,),
                    drafter_state=DRAFTER_STATE_INTERNAL, supports_narrow_decode=True)
