"""The committed gencode in proto/ is fresh, and imports under protobuf 5 and the newest."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from pdserve.proto import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    generate,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
)

OLDEST_PROTOBUF = "5.26.1"  # pyproject: protobuf>=5.26


def _without_json_names(file_proto: descriptor_pb2.FileDescriptorProto):
    """``CopyToProto`` leaves ``json_name`` out; protoc's descriptor sets fill it in (also
    in nested types, such as a ``map`` field's entry)."""
    def clear(messages) -> None:
        for message in messages:
            for field in message.field:
                field.ClearField("json_name")
            clear(message.nested_type)

    clear(file_proto.message_type)
    return file_proto


def test_committed_descriptors_match_the_proto_files():
    """Offline staleness check: compile the .proto files with the installed protoc and
    compare descriptors with the committed modules' (independent of protoc version)."""
    with tempfile.TemporaryDirectory() as tmp:
        names = generate.stage(Path(tmp))
        out = Path(tmp, "descriptors.pb")
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp}",
                        f"--descriptor_set_out={out}", *names], check=True, cwd=tmp)
        compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    for fresh, module in zip(compiled.file, (common_pb2, prefill_pb2, decode_pb2, router_pb2),
                             strict=True):
        committed = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(committed)
        assert _without_json_names(fresh) == _without_json_names(committed), (
            f"{fresh.name} changed: run python proto/generate.py")


def test_committed_gencode_is_byte_identical_to_a_fresh_one(tmp_path):
    try:
        generate.generate(tmp_path)
    except RuntimeError as exc:
        pytest.skip(f"pinned grpcio-tools unavailable here: {str(exc)[:200]}")
    assert generate.stale_files(tmp_path) == [], "stale gencode: run python proto/generate.py"


_IMPORT_CHECK = """
import warnings
warnings.simplefilter("error")
import google.protobuf
from pdserve.proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
params = common_pb2.SamplingParams(temperature=0.0, seed=7, stop_token_ids=[2, 3])
request = decode_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2], first_token_id=5,
                                   sampling_params=params)
again = decode_pb2.DecodeRequest.FromString(request.SerializeToString())
assert again == request and again.sampling_params.HasField("temperature")
assert not again.sampling_params.HasField("top_p") and again.HasField("first_token_id")
assert hasattr(prefill_pb2_grpc, "PrefillWorkerStub")
assert hasattr(decode_pb2_grpc, "add_DecodeWorkerServicer_to_server")
print(google.protobuf.__version__)
"""


def _protobuf_target(version: str) -> Path:
    target = Path.home() / ".cache" / "pdserve" / f"protobuf-{version}"
    if not (target / f"protobuf-{version}.dist-info").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "--no-deps", "--target", str(target), f"protobuf=={version}"]
        if subprocess.run(cmd, check=False, capture_output=True).returncode != 0:
            pytest.skip(f"cannot pip install protobuf=={version} here")
    return target


def test_gencode_imports_under_the_oldest_supported_protobuf():
    target = _protobuf_target(OLDEST_PROTOBUF)
    done = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], check=False,
                          capture_output=True, text=True,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == OLDEST_PROTOBUF


def test_gencode_imports_under_the_installed_protobuf():
    done = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], check=False,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_sampling_params_presence_distinguishes_unset_from_zero():
    params = common_pb2.SamplingParams(temperature=0.0)
    assert params.HasField("temperature") and not params.HasField("max_tokens")
    assert not params.HasField("logprobs")
    assert params.top_k == 0 and list(params.stop_token_ids) == []


def test_services_have_the_contract_methods():
    prefill = prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"]
    decode = decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"]
    assert [m.name for m in prefill.methods] == ["Prefill", "SendKV", "GrantKV", "Release",
                                                 "Health"]
    assert [m.name for m in decode.methods] == ["Decode", "DecodeSession", "Abort", "Health"]
    assert decode.methods_by_name["Decode"].server_streaming
    session = decode.methods_by_name["DecodeSession"]
    assert session.client_streaming and session.server_streaming
    assert hasattr(prefill_pb2_grpc, "PrefillWorkerServicer")
    assert hasattr(decode_pb2_grpc, "DecodeWorkerStub")
