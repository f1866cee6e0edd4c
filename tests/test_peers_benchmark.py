"""``benchmarks/peers.py`` without its peers: the model it serves everywhere, and the
ratios it reports from ``vllm bench serve`` results."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def peers():
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("peers", BENCHMARKS / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_model_has_a_32000_id_tokenizer_that_matches_its_config(peers, tmp_path):
    """transformers and pdserve load it; BOS and EOS agree between the tokenizer and the
    configs, and pdserve generates from it."""
    from model_shapes import W1_VOCAB_SIZE, prepare_model
    from transformers import AutoTokenizer

    from pdserve.engine import LLM, SamplingParams

    model = prepare_model("w1", tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    generation = json.loads((model / "generation_config.json").read_text())
    assert len(tokenizer) == W1_VOCAB_SIZE == config["vocab_size"]
    assert config["bos_token_id"] == generation["bos_token_id"] == tokenizer.bos_token_id
    assert config["eos_token_id"] == generation["eos_token_id"] == tokenizer.eos_token_id
    assert tokenizer("hello world").input_ids[0] == tokenizer.bos_token_id
    llm = LLM(str(model), dtype="bfloat16", max_model_len=64, load_progress=False)
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=3,
                                                       ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert prepare_model("w1", tmp_path) == model  # kept, not rewritten
    assert prepare_model(str(model), tmp_path / "elsewhere") == model  # a folder as it is
    with pytest.raises(FileNotFoundError, match="qwen3-0.6b"):
        prepare_model("no-such-shape", tmp_path)


def bench_result(throughput: float, ttft: float, tpot: float) -> dict:
    """The fields of a ``vllm bench serve --save-result`` file that peers.py reads."""
    return {"completed": 64, "num_prompts": 64, "duration": 8192 / throughput,
            "total_input_tokens": 16384, "total_output_tokens": 8192,
            "output_throughput": throughput, "mean_ttft_ms": ttft, "median_ttft_ms": ttft,
            "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": tpot, "median_tpot_ms": tpot,
            "p99_tpot_ms": 1.2 * tpot, "mean_itl_ms": tpot, "p99_itl_ms": 3 * tpot}


def test_ratios_are_the_targets_ratios(peers):
    rounds = [{"pdserve": peers.summarize_bench(bench_result(880, 900, 33)),
               "vllm": peers.summarize_bench(bench_result(800, 1000, 36))},
              {"pdserve": peers.summarize_bench(bench_result(820, 950, 35)),
               "vllm": peers.summarize_bench(bench_result(760, 1000, 35))}]
    offline = {"pdserve": {"output_throughput": 1000.0}, "vllm": {"output_throughput": 800.0}}
    ratios = peers.ratios({"served": rounds, "offline": offline})
    assert rounds[0]["pdserve"]["failed"] == 0
    assert ratios["served_pdserve_over_vllm"] == pytest.approx([1.1, 820 / 760])
    assert ratios["served_best_over_best"] == pytest.approx(1.1)
    assert ratios["ttft_pdserve_over_vllm"] == pytest.approx([0.9, 0.95])
    assert ratios["tpot_pdserve_over_vllm"] == pytest.approx([33 / 36, 1.0])
    assert ratios["served_over_offline_pdserve"] == pytest.approx(0.88)
    assert ratios["offline_pdserve_over_vllm"] == pytest.approx(1.25)
    assert peers.ratios({"offline": offline}) == {"offline_pdserve_over_vllm": 1.25}


def test_served_path_reports_served_over_offline_per_shape(peers, capsys):
    """``served_path.py``'s table: each shape's runs against its offline figure, the best
    ratio, and a mark on a shape under the 0.95 target."""
    import served_path

    runs = [peers.summarize_bench(bench_result(t, 900, 33)) for t in (900.0, 950.0)]
    results = {"w1": {"offline": {"output_throughput": 1000.0}, "served": runs,
                      "served_over_offline": [0.9, 0.95], "best_served_over_offline": 0.95,
                      "mean_ttft_ms": [900, 900], "mean_tpot_ms": [33, 33],
                      "p99_itl_ms": [99, 99]},
               "smollm2": {"offline": {"output_throughput": 600.0}, "served": runs[:1],
                           "served_over_offline": [0.8], "best_served_over_offline": 0.8,
                           "mean_ttft_ms": [900], "mean_tpot_ms": [33], "p99_itl_ms": [99]}}
    served_path.report(results)
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()
             if line.split() and line.split()[0] in results}
    assert "0.90, 0.95" in lines["w1"] and "under target" not in lines["w1"]
    assert "0.80" in lines["smollm2"] and "under target" in lines["smollm2"]
