"""Where --model comes from: a hub id resolved from a populated Hugging Face cache through
huggingface_hub's own cache code (HF_HUB_OFFLINE=1), and the refusals, at start-up and
naming the field, of checkpoints pdserve would not compute exactly."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_checkpoint
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.engine.config import UnsupportedModelError
from pdserve.engine.demo_model import make_demo_model
from pdserve.engine.hub import ModelNotFoundError, resolve_model
from pdserve.engine.model_resolution import check_model, resolve_model_paths

REPO = "pdserve-tests/tiny-demo"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hf_cache(hub_cache: Path, repo_id: str, folder: Path, commit: str = COMMIT) -> Path:
    """Lay ``folder``'s files out as huggingface_hub's cache keeps a downloaded snapshot:
    ``models--org--name/blobs/<sha256>``, ``snapshots/<commit>/<file>`` linking to its
    blob, and ``refs/main`` naming the commit. Returns the snapshot folder."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    demo = make_demo_model(tmp_path_factory.mktemp("demo") / "demo")
    add_to_hf_cache(home / "hub", REPO, demo)
    return home


def test_the_cache_layout_is_huggingface_hubs_own(hf_home):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hf_home / "hub")
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and [r.commit_hash for r in repo.revisions] == [COMMIT]


def test_a_hub_id_resolves_from_the_cache_offline(hf_home):
    hub = str(hf_home / "hub")
    path = resolve_model(REPO, download_dir=hub)
    assert Path(path) == hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / \
        COMMIT
    assert resolve_model(REPO, revision=COMMIT, download_dir=hub) == path
    config = resolve_model_paths(EngineConfig(REPO, download_dir=hub))
    assert (config.model, config.served_model_name) == (path, REPO)
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE=1"):
        resolve_model("pdserve-tests/absent", download_dir=hub)
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face hub id"):
        resolve_model("./no/such/folder")


def test_pdserve_generate_runs_a_hub_id_from_HF_HOME(hf_home):
    """The whole path in a fresh process: HF_HOME and HF_HUB_OFFLINE as a user sets them."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.entrypoints.cli", "generate", "--model", REPO, "--json",
         "--prompt", "The sea", "--max-tokens", "6", "--dtype", "float32",
         "--max-model-len", "64"], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    text = json.loads(run.stdout.strip().splitlines()[-1])["text"]
    local = resolve_model(REPO, download_dir=str(hf_home / "hub"))
    expected = LLM(local, dtype="float32", max_model_len=64, load_progress=False).generate(
        ["The sea"], SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].text
    assert text == expected


def edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_tiny_checkpoint(tmp_path / "tiny", "llama")


@pytest.mark.parametrize(("changes", "named"), [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures=['GPT2LMHeadModel']"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "quantization_config.quant_method='bitsandbytes'"),
    ({"hidden_size": None}, "lacks 'hidden_size'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unsupported_checkpoints_are_refused_naming_the_field(changes, named, tiny):
    with pytest.raises(UnsupportedModelError) as info:
        check_model(EngineConfig(str(edit_config(tiny, **changes))))
    assert named in str(info.value)


def test_a_tensor_with_no_place_is_refused_before_any_is_read(tiny):
    weights = load_file(tiny / "model.safetensors")
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(weights, tiny / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="model.layers.0.self_attn.q_norm.weight"):
        check_model(EngineConfig(str(tiny)))
    with pytest.raises(UnsupportedModelError, match="q_norm"):
        LLM(str(tiny), load_progress=False)


def test_pdserve_serve_refuses_at_start_up_before_anything_starts(tiny, tmp_path):
    edit_config(tiny, quantization_config={"quant_method": "gptq", "bits": 3})
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.entrypoints.cli", "serve", str(tiny), "--port", "0",
         "--grpc-port", "0"], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "RAY_ADDRESS": ""})
    assert run.returncode == 2, run.stderr[-2000:]
    assert "pdserve: error: quantization_config.bits=3 is not supported" in run.stderr
    assert "Redis at" not in run.stdout and "Ray" not in run.stdout  # nothing was started
    shutil.rmtree(tiny)
    missing = subprocess.run(
        [sys.executable, "-m", "pdserve.entrypoints.cli", "serve", str(tiny), "--port", "0",
         "--grpc-port", "0"], capture_output=True, text=True, timeout=300, check=False)
    assert missing.returncode == 2 and "not a Hugging Face hub id" in missing.stderr
