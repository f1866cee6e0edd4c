"""lm-evaluation-harness against ``pdserve serve``: its ``local-completions`` model (echo
with logprobs on ``/v1/completions``, the tokenizer read from ``/tokenizer_info`` and
``/tokenize``) scores a multiple-choice task, and its ``hf`` model scores the same task on
the same file in transformers; the two runs' log-likelihoods and accuracies are compared.

The task is our own (12 short questions, four choices each, written here into
``--work``), so that nothing is downloaded. Both runs compute in float32 (transformers'
dtype for a GGUF file). Needs ``pip install "lm-eval[api]"`` in the Python given as
``--lm-eval-python`` (its ``lm_eval`` script beside it).

    python benchmarks/lm_eval_check.py --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --lm-eval-python /path/to/venv/bin/python

Prints the largest difference between the two runs' log-likelihoods and both runs'
accuracies; exits 1 when they differ by more than ``--tolerance`` (default 1e-3).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from peers import Server

from pdserve.entrypoints.redis_server import free_port

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What is the capital of Germany?", ["Rome", "Berlin", "Lisbon", "Vienna"], 1),
    ("What is the capital of Italy?", ["Athens", "Madrid", "Rome", "Oslo"], 2),
    ("What is the capital of Spain?", ["Madrid", "Paris", "Prague", "Dublin"], 0),
    ("What is the capital of Japan?", ["Beijing", "Seoul", "Bangkok", "Tokyo"], 3),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("What color is grass?", ["blue", "red", "green", "purple"], 2),
    ("Which planet is closest to the Sun?", ["Mercury", "Mars", "Jupiter", "Saturn"], 0),
    ("What is 2 + 2?", ["three", "five", "four", "six"], 2),
    ("What do bees make?", ["milk", "honey", "silk", "wax paper"], 1),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], 1),
    ("Which animal barks?", ["cat", "cow", "dog", "fish"], 2),
]
TASK = "pdserve_facts_mc"
SERVED_NAME = "lm-eval-model"


def write_task(folder: Path) -> None:
    """The task's data (JSON lines) and its lm-evaluation-harness YAML in ``folder``."""
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")


def run_lm_eval(args, folder: Path, name: str, model: str, model_args: str) -> dict:
    """One ``lm_eval`` run; returns {"acc", "acc_norm", "loglikelihoods": {doc: [...]}}."""
    lm_eval = Path(args.lm_eval_python).parent / "lm_eval"
    out = folder / f"out-{name}"
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run([str(lm_eval), "--model", model, "--model_args", model_args, "--tasks",
                    TASK, "--include_path", str(folder), "--output_path", str(out),
                    "--log_samples", "--batch_size", "4"], env=env, check=True,
                   timeout=args.timeout_s)
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][TASK]
    samples = [json.loads(line) for line in
               next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()]
    return {"acc": results["acc,none"], "acc_norm": results["acc_norm,none"],
            "loglikelihoods": {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]]
                               for s in samples}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file or checkpoint folder")
    parser.add_argument("--lm-eval-python", required=True,
                        help="the Python whose environment has lm-eval[api]")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    folder = args.work or Path(tempfile.mkdtemp(prefix="pdserve-lm-eval-"))
    folder.mkdir(parents=True, exist_ok=True)
    write_task(folder)
    model = Path(args.model).resolve()
    port = free_port()
    server = Server("pdserve serve", [
        "pdserve", "serve", "--model", str(model), "--port", str(port), "--grpc-port",
        str(free_port()), "--dtype", "float32", "--served-model-name", SERVED_NAME,
        "--enable-tokenizer-info-endpoint"], folder / "server.log")
    try:
        server.wait_ready(f"http://127.0.0.1:{port}/health")
        served = run_lm_eval(args, folder, "served", "local-completions", (
            f"base_url=http://127.0.0.1:{port}/v1/completions,model={SERVED_NAME},"
            "num_concurrent=4,tokenizer_backend=remote"))
    finally:
        server.stop()
    hf_args = (f"pretrained={model.parent},gguf_file={model.name}" if model.suffix == ".gguf"
               else f"pretrained={model}")
    reference = run_lm_eval(args, folder, "hf", "hf", hf_args + ",dtype=float32")
    diffs = [abs(a - b) for doc, values in reference["loglikelihoods"].items()
             for a, b in zip(values, served["loglikelihoods"][doc], strict=True)]
    print(f"{len(diffs)} continuations: largest log-likelihood difference {max(diffs):.2e}")
    for key in ("acc", "acc_norm"):
        print(f"{key}: served {served[key]:.4f}, transformers {reference[key]:.4f}")
    if max(diffs) > args.tolerance or any(served[k] != reference[k]
                                          for k in ("acc", "acc_norm")):
        sys.exit(1)


if __name__ == "__main__":
    main()
