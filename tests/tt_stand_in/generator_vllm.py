# SPDX-License-Identifier: Apache-2.0
"""TEST DOUBLE standing in for TT-Transformers' vLLM classes (tt-metal models/tt_transformers/tt/generator_vllm.py),
over the stand-in TT-Transformers (tt_transformers.py) and ttnn (ttnn.py). It is not tt-metal's file and proves nothing
about it: it mirrors what serving/ttnn_model.py relies on, read in the 2026 version of generator_vllm.py whose
LlamaForCausalLM declares supports_async_decode and supports_sample_on_device (its commit is not shown by the index;
the structure matches generator_vllm.py@0015d62b except where named):

- allocate_vllm_kv_cache(kv_cache_shape, dtype, num_layers, dp_model, tt_cache_path): per data-parallel model, per
  layer, [k, v] of ttnn.as_tensor(torch.zeros(kv_cache_shape, dtype=dtype), device=submesh,
  mesh_mapper=ReplicateTensorToMesh, layout=TILE, memory_config=DRAM, dtype=<the preset's KV_CACHE dtype, else
  bfloat8_b>, cache_file_name=tt_cache_path / f"empty_{kv}cache_paged_attention{shape}_t{i}") (the 2026 version goes
  through allocate_vllm_kv_cache_per_layer with tensor_idx i per layer; 0015d62b names the file without _t{i});
- initialize_vllm_text_transformer: per submesh ModelArgs(submesh, instruct=("Instruct" in _name_or_path ...),
  max_batch_size=max_batch_size // tt_data_parallel, optimizations=lambda a: optimizations(a.n_layers, a.model_name),
  max_seq_len=max_seq_len), the model-name assertion against hf_config._name_or_path, n_layers applied, then
  `Transformer(args=..., mesh_device=..., dtype=..., state_dict=..., weight_cache_path=..., use_paged_kv_cache=True)`,
  looked up in this module's globals at call time as in tt-metal's;
- LlamaForCausalLM(Generator) and MistralForCausalLM(Generator): model_capabilities, initialize_vllm_model(hf_config,
  mesh_device, max_batch_size, max_seq_len, n_layers=None, tt_data_parallel=1, optimizations="performance") (Llama's
  N150 max_model_len check left out: no real model name here), cache_path, prefill_forward -> prefill_forward_text,
  decode_forward -> Generator.decode_forward (the 2026 version; 0015d62b's went to decode_forward_text),
  allocate_kv_cache -> allocate_vllm_kv_cache.
"""
import torch

from . import ttnn
from .tt_transformers import DecodersPrecision, Generator, ModelArgs, TensorGroup, Transformer, create_submeshes


def allocate_vllm_kv_cache(kv_cache_shape, dtype, num_layers, dp_model, tt_cache_path):
    kv_cache = []
    for model in dp_model:
        submesh, kv_tt = model.mesh_device, []
        for layer_num in range(num_layers):
            optimizations = model.args.optimizations
            kv_dtype = (optimizations.get_tensor_dtype(decoder_id=layer_num, tensor=TensorGroup.KV_CACHE)
                        if optimizations is not None else None)
            kv_dtype = ttnn.bfloat8_b if kv_dtype is None else kv_dtype
            kv_tt.append([ttnn.as_tensor(torch.zeros(kv_cache_shape, dtype=dtype), device=submesh,
                                         mesh_mapper=ttnn.ReplicateTensorToMesh(submesh), layout=ttnn.TILE_LAYOUT,
                                         memory_config=ttnn.DRAM_MEMORY_CONFIG, dtype=kv_dtype,
                                         cache_file_name=tt_cache_path / f"empty_{kv}cache_paged_attention"
                                                                         f"{tuple(kv_cache_shape)}_t{layer_num}")
                          for kv in ("k", "v")])
        kv_cache.append(kv_tt)
    return kv_cache


def initialize_vllm_text_transformer(hf_config, tt_data_parallel, mesh_device, max_batch_size, max_seq_len,
                                     n_layers=None, dtype=ttnn.bfloat8_b, optimizations=DecodersPrecision.performance):
    model_args = []
    for submesh in create_submeshes(mesh_device, tt_data_parallel):
        args = ModelArgs(submesh, instruct="Instruct" in hf_config._name_or_path,
                         max_batch_size=max_batch_size // tt_data_parallel,
                         optimizations=lambda a: optimizations(a.n_layers, a.model_name), max_seq_len=max_seq_len)
        assert args.model_name.replace("-", "") in hf_config._name_or_path.replace("-", ""), \
            f"The model specified in vLLM ({hf_config._name_or_path}) does not match the model name ({args.model_name})"
        if n_layers is not None:
            args.n_layers = n_layers
        model_args.append(args)
    state_dict = model_args[0].load_state_dict()
    tt_model = [Transformer(args=model_args[i], mesh_device=submesh, dtype=dtype, state_dict=state_dict,
                            weight_cache_path=model_args[i].weight_cache_path(dtype), use_paged_kv_cache=True)
                for i, submesh in enumerate(create_submeshes(mesh_device, tt_data_parallel))]
    return tt_model, model_args


class _TextForCausalLM(Generator):  # tt-metal writes LlamaForCausalLM's and MistralForCausalLM's bodies out twice
    model_capabilities = {"supports_prefix_caching": True, "supports_async_decode": True,
                          "supports_sample_on_device": True}

    @classmethod
    def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size, max_seq_len, n_layers=None,
                              tt_data_parallel=1, optimizations: str = "performance"):
        tt_model, model_args = initialize_vllm_text_transformer(
            hf_config, tt_data_parallel, mesh_device, max_batch_size, max_seq_len=max_seq_len, n_layers=n_layers,
            dtype=ttnn.bfloat8_b, optimizations=DecodersPrecision.from_string(optimizations)
            if optimizations is not None else DecodersPrecision.performance)
        return cls(tt_model, model_args, mesh_device)

    @property
    def cache_path(self):
        return self.model_args[0].model_cache_path

    def prefill_forward(self, *args, **kwargs):
        return super().prefill_forward_text(*args, **kwargs)

    def decode_forward(self, *args, **kwargs):
        return super().decode_forward(*args, **kwargs)

    def allocate_kv_cache(self, *args, **kwargs):
        return allocate_vllm_kv_cache(*args, **kwargs, dp_model=self.model, tt_cache_path=self.cache_path)


class LlamaForCausalLM(_TextForCausalLM):
    pass


class MistralForCausalLM(_TextForCausalLM):
    pass
