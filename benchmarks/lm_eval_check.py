"""lm-evaluation-harness against ``pdserve serve``: its ``local-completions`` model (echo
with logprobs on ``/v1/completions``, the tokenizer read from ``/tokenizer_info`` and
``/tokenize``) scores two tasks, and its ``hf`` model scores them on the same file in
transformers; the two runs' log-likelihoods and metrics are compared.

The tasks are our own, written here into ``--work`` so that nothing is downloaded: a
multiple-choice one (12 short questions, four choices each: ``loglikelihood`` requests)
and a perplexity one (the paragraphs of pdserve's demo corpus, each under lm-eval's
2048-token window: ``loglikelihood_rolling``). Both runs compute in float32
(transformers' dtype for a GGUF file). Needs ``pip install "lm-eval[api]"`` in the Python
given as ``--lm-eval-python`` (its ``lm_eval`` script beside it).

    python benchmarks/lm_eval_check.py --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --lm-eval-python /path/to/venv/bin/python

Prints the largest difference between the two runs' log-likelihoods and both runs'
metrics; exits 1 when a log-likelihood differs by more than ``--tolerance`` (default
1e-3), an accuracy at all, or a perplexity by more than that tolerance relatively.
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
TASKS = {"pdserve_facts_mc": ("acc", "acc_norm"),
         "pdserve_corpus_ppl": ("word_perplexity", "byte_perplexity")}
SERVED_NAME = "lm-eval-model"


def write_tasks(folder: Path) -> None:
    """The tasks' data (JSON lines) and their lm-evaluation-harness YAML in ``folder``."""
    from pdserve.engine import demo_model

    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (folder / "pdserve_facts_mc.yaml").write_text(
        f"task: pdserve_facts_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    corpus = (Path(demo_model.__file__).parent / "data" / "demo_corpus.txt").read_text()
    paragraphs = [p.strip() for p in corpus.split("\n\n") if len(p.strip()) > 200][:8]
    text = folder / "corpus.jsonl"
    text.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    (folder / "pdserve_corpus_ppl.yaml").write_text(
        f"task: pdserve_corpus_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {text}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n")


def run_lm_eval(args, folder: Path, name: str, model: str, model_args: str) -> dict:
    """One ``lm_eval`` run of both tasks; returns {task: {metric: value, ...,
    "loglikelihoods": {(doc, i): value}}}."""
    lm_eval = Path(args.lm_eval_python).parent / "lm_eval"
    out = folder / f"out-{name}"
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run([str(lm_eval), "--model", model, "--model_args",
                    model_args + ",max_length=2048", "--tasks", ",".join(TASKS),
                    "--include_path", str(folder), "--output_path", str(out),
                    "--log_samples", "--batch_size", "4"], env=env, check=True,
                   timeout=args.timeout_s)
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    runs = {}
    for task, metrics in TASKS.items():
        samples = [json.loads(line) for line in
                   next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
        runs[task] = {m: results[task][f"{m},none"] for m in metrics}
        runs[task]["loglikelihoods"] = {
            (s["doc_id"], i): float(r[0] if isinstance(r, list) else r)
            for s in samples for i, r in enumerate(s["filtered_resps"])}
    return runs


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
    write_tasks(folder)
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
    failed = False
    for task, metrics in TASKS.items():
        ours, theirs = served[task], reference[task]
        diffs = [abs(value - ours["loglikelihoods"][key])
                 for key, value in theirs["loglikelihoods"].items()]
        print(f"{task}: {len(diffs)} log-likelihoods, largest difference {max(diffs):.2e}")
        failed |= max(diffs) > args.tolerance
        for m in metrics:
            print(f"  {m}: served {ours[m]:.6g}, transformers {theirs[m]:.6g}")
            failed |= (ours[m] != theirs[m] if m.startswith("acc")
                       else abs(ours[m] / theirs[m] - 1) > args.tolerance)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
