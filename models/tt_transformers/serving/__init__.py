# SPDX-License-Identifier: Apache-2.0
"""Serving through vLLM with vllm-tt-plugin: its speculative-decoding contract (contract.py), this package's plan
and capabilities (plan.py), the verify mapping and drafter slots any backend shares (core.py, proposer.py), the torch
backend's model (torch_model.py) and a runner written from the contract (reference_runner.py). docs/serving.md."""
