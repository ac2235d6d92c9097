# SPDX-License-Identifier: Apache-2.0
r"""Speculative decoding demo, in the shape of TT-Transformers' simple_text_demo.

    .venv/bin/pytest models/tt_transformers/demo/speculative_decoding/speculative_demo.py::test_speculative_demo \
        --n_draft_tokens 4
    .venv/bin/python models/tt_transformers/demo/speculative_decoding/speculative_demo.py --n_draft_tokens 4

With no flags it runs the embedded default model (SmolLM2-135M-Instruct) on the sample_prompts.json beside this
file; HF_MODEL (or --model) points at a local Llama/Mistral checkpoint folder, a GGUF file, or a hub id already in
the local Hugging Face cache. Options (options.py), input checks (inputs.py), models (build.py), the run (here) and
its report (report.py).
"""
import sys
import textwrap
from pathlib import Path
from typing import Optional

if __name__ == "__main__":  # `python path/to/speculative_demo.py` from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

INTERRUPTED = "interrupted (Ctrl-C): stopped, no report written"

try:  # torch and the models import here, for seconds: Ctrl-C meanwhile gets the same one line as later
    import pytest
    from loguru import logger

    from models.tt_transformers.demo.speculative_decoding.build import (
        ModelPool,
        build,
        describe_drafter,
        trace_region_size,
    )
    from models.tt_transformers.demo.speculative_decoding.inputs import (
        CheckedInputs,
        DemoInputError,
        backend_of,
        check_flags,
        check_inputs,
        flags_named,
        sampling_params,
    )
    from models.tt_transformers.demo.speculative_decoding.options import DemoConfig, argument_parser, config_from_pytest
    from models.tt_transformers.demo.speculative_decoding.report import (
        PROMPT_ECHO,
        LoadMeter,
        ReportFile,
        performance_lines,
        prompt_entries,
        prompt_table_lines,
        result_lines,
        shorten,
        speedup_lines,
        timing_warnings,
    )
    from models.tt_transformers.errors import UserError
    from models.tt_transformers.records import environment
    from models.tt_transformers.speculative.drafters import HybridDrafter
    from models.tt_transformers.speculative.generator import SpeculativeGenerator
    from models.tt_transformers.speculative.drafters.eagle3 import HeadDrafter
    from models.tt_transformers.speculative.results import UserResult, summarize
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise
    sys.stderr.write(f"{INTERRUPTED}\n")
    sys.exit(130)


def generate_all(generator: SpeculativeGenerator, tokens: list[list[int]], batches: list[list[int]],
                 config: DemoConfig) -> list[list[UserResult]]:
    return [generator.generate([tokens[i] for i in batch], config.max_generated_tokens, bool(config.stop_at_eos),
                               requests=batch) for batch in batches]


def run_demo(config: DemoConfig, mesh_device=None, pool: Optional[ModelPool] = None) -> dict:
    """The demo on the backend --backend picks (ttnn: on `mesh_device`); returns the report. Models come from
    `pool` (reused across runs, released by its owner); without one the run builds its own and releases them."""
    own_pool = pool is None
    pool = ModelPool() if own_pool else pool
    try:
        return run_on(config, mesh_device, pool)
    finally:
        if own_pool:
            pool.close()


def run_on(config: DemoConfig, mesh_device, pool: ModelPool) -> dict:
    """Checks, then the run; --output_json is reserved between the two and written only with the whole report."""
    checked = check_inputs(config)
    report_file = ReportFile(config.output_json) if config.output_json else None
    try:
        report = decode_and_report(config, checked, mesh_device, pool)
    except BaseException:  # an error or Ctrl-C: no report file, not even an empty one
        if report_file is not None:
            report_file.discard()
        raise
    if report_file is not None:
        report_file.write(report)
        logger.info(f"Report written to {config.output_json}")
    return report


def decode_and_report(config: DemoConfig, checked: CheckedInputs, mesh_device, pool: ModelPool) -> dict:
    """Build, warm up, decode speculatively and (--compare_baseline) plainly, and log the report it returns."""
    with flags_named():  # what only a built model knows (a Galaxy's rows per step, a device head's chain)
        tokenizer, target, drafter, draft_lm, tokens, eos = build(config, checked, mesh_device, pool)
    sampling = sampling_params(config)
    log_iterations = None if config.log_iterations == -1 else config.log_iterations
    spec = SpeculativeGenerator(target, drafter, config.n_draft_tokens, eos, sampling, log_iterations,
                                bool(config.draft_trees))
    with flags_named():
        for batch in checked.batches:  # every prompt fits before anything runs
            spec.check_prompts([tokens[i] for i in batch])
    compile_times = spec.warm_up()
    logger.info(f"Compile and warm-up (not timed): prefill {compile_times['compile_prefill']:.1f}s, decode "
                f"{compile_times['compile_decode']:.1f}s")

    logger.info(f"Speculative decoding: {checked.ckpt.name}, {target.n_layers} target layers, batch "
                f"{config.batch_size}, n_draft_tokens={config.n_draft_tokens}, "
                f"{'greedy' if sampling.greedy else f'sampling {sampling}'}")
    logger.info(textwrap.fill(f"Drafting: {describe_drafter(config, checked)}", width=100, subsequent_indent="  "))
    load = {}
    with LoadMeter() as meter:
        results = generate_all(spec, tokens, checked.batches, config)
    load["speculative"] = meter.load
    summary = {**summarize(results, config.n_draft_tokens), **compile_times}
    head = drafter.fallback if isinstance(drafter, HybridDrafter) else drafter
    if isinstance(head, HeadDrafter):  # what a head run cost on this machine, as its length policy priced it
        summary["draft_head_run_cost"] = head.draft_cost
        logger.info(f"Draft head: a run measured at {head.draft_cost:.3f} of a target step")
    for line in performance_lines("speculative", summary):
        logger.info(line)

    baseline = None
    if config.compare_baseline and config.n_draft_tokens > 0:
        logger.info("Plain decoding on the same backend (baseline)")
        with LoadMeter() as meter:
            baseline = generate_all(SpeculativeGenerator(target, None, 0, eos, sampling, log_iterations), tokens,
                                    checked.batches, config)
        load["plain"] = meter.load
        summary["baseline"] = summarize(baseline, 0)
        for line in performance_lines("plain decoding", summary["baseline"]):
            logger.info(line)
        summary["baseline_decode_tok_s"] = summary["baseline"]["decode_tok_s"]
        summary["speedup"] = summary["decode_tok_s"] / summary["baseline_decode_tok_s"]
        if sampling.greedy or sampling.seed is not None:  # a seeded draw depends on (seed, prompt, position) alone
            summary["identical_to_baseline"] = all(
                r.output_tokens == b.output_tokens for rb, bb in zip(results, baseline) for r, b in zip(rb, bb))
        for line in speedup_lines(summary):
            logger.info(line)

    env = environment(target.device_name)
    summary["load"] = load
    summary["warnings"] = timing_warnings(summary, load, env)
    for line in summary["warnings"]:
        logger.warning(line)
    report = {"config": {**vars(config), "model_name": checked.ckpt.name, "target_layers": target.n_layers},
              "environment": env, "summary": summary,
              "prompts": prompt_entries(checked.prompts, checked.batches, results, baseline, tokenizer)}
    for i, entry in enumerate(report["prompts"]):
        logger.info(f"User {i} prompt: {shorten(entry['prompt'], PROMPT_ECHO)!r}\nOutput: {entry['output_text']}")
    logger.info("Per prompt:\n" + "\n".join(prompt_table_lines(report["prompts"])))
    return report


RESULT_LINES = pytest.StashKey[list]()  # the pytest form's result, shown in pytest's summary (conftest.py)


def test_speculative_demo(request):
    """The demo as a pytest test; on the ttnn backend (MESH_DEVICE set, or --backend ttnn) it runs on the
    `mesh_device` fixture (conftest.py: the fabric and a trace region sized for these options, as tt-metal's
    fixture opens a mesh for its text demo). Its result shows in pytest's summary, without -s."""
    config = config_from_pytest(request.config)
    mesh_device = request.getfixturevalue("mesh_device") if backend_of(config) == "ttnn" else None
    try:
        report = run_demo(config, mesh_device)
    except UserError as e:  # what only loading finds (a corrupt checkpoint): its one line, no source listing
        pytest.fail(str(e), pytrace=False)
    request.config.stash[RESULT_LINES] = result_lines(report)
    assert all(p["output_tokens"] for p in report["prompts"])
    if "identical_to_baseline" in report["summary"]:
        assert report["summary"]["identical_to_baseline"], "speculative output differs from plain decoding"


LOG_FORMAT = "<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}"  # fits a 120-column terminal


def main(argv=None) -> int:
    config = DemoConfig(**vars(argument_parser(__doc__).parse_args(argv)))
    try:
        if backend_of(config) == "ttnn":
            from models.tt_transformers.ttnn_backend.device import mesh_shape, model_mesh, open_mesh

            check_flags(config, "ttnn")
            try:
                shape = mesh_shape()
            except ValueError as e:  # MESH_DEVICE names no mesh tt-metal knows
                raise DemoInputError(str(e)) from None
            with open_mesh(trace_region_size=trace_region_size(config, shape)) as mesh_device:
                report = run_demo(config, model_mesh(mesh_device))  # a Galaxy's: one of TT's 1 x 8 submeshes
        else:
            report = run_demo(config)
    except UserError as e:  # bad input (a flag, a file, a checkpoint): its one line, no traceback; a bug keeps its own
        logger.error(str(e))
        return 2
    except KeyboardInterrupt:  # nothing half-written is left: reports are written whole or not at all
        logger.error(INTERRUPTED)
        return 130
    return 0 if report["summary"].get("identical_to_baseline", True) else 1


if __name__ == "__main__":
    logger.remove()  # the CLI's own log format; as a library or under pytest the caller's handlers stay
    logger.add(sys.stderr, format=LOG_FORMAT)
    sys.exit(main())
