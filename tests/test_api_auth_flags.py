"""Client and admin API keys as ``pdserve serve``'s flags and the environment give them
(``router/flags.py``, ``router/api_keys.py``), and what start-up logs of their exposure: no
cluster. The keys on real routers are ``test_api_auth.py``'s.
"""

from __future__ import annotations

import pytest

from pdserve.entrypoints.cli import build_parser
from pdserve.router.api_keys import AdminAuth, ApiKeyAuth, load_api_keys
from pdserve.router.flags import admin_auth_from_args, api_auth_from_args, log_exposure

KEY = "sk-first-0123456789abcdef"  # a valid client key (test_api_auth's first key)


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_no_key_anywhere_means_no_client_authentication():
    assert api_auth_from_args(parse(), environ={}) is None
    assert load_api_keys([], None, {}) == ([], None)


def test_environment_keys_pdserve_first_then_vllm():
    both = {"PDSERVE_API_KEY": "sk-pd", "VLLM_API_KEY": "sk-vllm"}
    assert load_api_keys([], None, both) == (["sk-pd"], "PDSERVE_API_KEY")
    assert load_api_keys([], None, {"VLLM_API_KEY": "sk-vllm"}) == (["sk-vllm"], "VLLM_API_KEY")
    auth = api_auth_from_args(parse(), environ={"VLLM_API_KEY": "sk-vllm"})
    assert auth.check([b"Bearer sk-vllm"]) is None
    assert auth.check([b"Bearer sk-pd"]) == "Invalid API key."


def test_flags_win_over_the_environment_and_add_up(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("sk-a\r\n\r\n  sk-b\t\n")
    keys, source = load_api_keys(["sk-flag"], str(key_file), {"PDSERVE_API_KEY": "sk-env"})
    assert (keys, source) == (["sk-flag", "sk-a", "sk-b"], "--api-key, --api-key-file")
    auth = api_auth_from_args(parse("--api-key-file", str(key_file)),
                              environ={"PDSERVE_API_KEY": "sk-env"})
    assert auth.check([b"Bearer sk-b"]) is None
    assert auth.check([b"Bearer sk-env"]) == "Invalid API key."


def test_a_key_on_the_command_line_warns_of_ps(caplog):
    with caplog.at_level("WARNING", logger="pdserve.router.flags"):
        api_auth_from_args(parse("--api-key", "sk-a"), environ={})
    assert "visible to other local users" in caplog.text and "PDSERVE_API_KEY" in caplog.text
    assert "sk-a" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pdserve.router.flags"):
        api_auth_from_args(parse(), environ={"PDSERVE_API_KEY": "sk-a"})
    assert caplog.text == ""


@pytest.mark.parametrize("environ, message", [
    ({"PDSERVE_API_KEY": ""}, "PDSERVE_API_KEY: the API key is empty"),
    ({"VLLM_API_KEY": ""}, "VLLM_API_KEY: the API key is empty"),
    ({"PDSERVE_API_KEY": " sk-a"}, "PDSERVE_API_KEY: an API key must be printable ASCII"),
])
def test_an_empty_or_unsendable_environment_key_is_refused(environ, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        api_auth_from_args(parse(), environ=environ)


@pytest.mark.parametrize("content, message", [
    ("", "holds no API key"), ("\n  \n", "holds no API key"),
    ("sk-a\nsk b\n", ", line 2: an API key must be printable ASCII"),
    (b"\xff\xfe", "is not UTF-8 text"),
])
def test_a_bad_key_file_is_refused_at_parse_time_naming_it(tmp_path, capsys, content, message):
    path = tmp_path / "keys"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SystemExit) as info:
        parse("--api-key-file", str(path))
    assert info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument --api-key-file: {path}" in error and message in error


@pytest.mark.parametrize("argv, message", [
    (["--api-key", ""], "argument --api-key: the API key is empty"),
    (["--api-key", "sk a"], "argument --api-key: an API key must be printable ASCII"),
    (["--api-key-file", "/no/such/file"],
     "argument --api-key-file: cannot read /no/such/file: No such file or directory"),
    (["--public-endpoints", "/health,metrics"],
     "argument --public-endpoints: 'metrics' is not a path"),
])
def test_bad_flags_stop_at_parse_time(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_public_endpoints_flag():
    assert parse().public_endpoints == {"/health", "/ready", "/metrics"}
    assert parse("--public-endpoints", "").public_endpoints == frozenset()
    assert parse("--public-endpoints", " /health , /v1/models,").public_endpoints == \
        {"/health", "/v1/models"}


def test_keys_never_show_in_a_repr():
    auth = ApiKeyAuth.of(["sk-secret"])
    assert "sk-secret" not in repr(auth) and "key_digests" not in repr(auth)


def test_admin_keys_from_flags_file_and_environment(tmp_path):
    key_file = tmp_path / "admin"
    key_file.write_text("sk-admin-a\nsk-admin-b\n")
    admin = admin_auth_from_args(parse("--admin-api-key-file", str(key_file)),
                                 environ={"PDSERVE_ADMIN_API_KEY": "sk-admin-env"})
    assert len(admin.key_digests) == 2 and admin.has_keys
    admin = admin_auth_from_args(parse(), environ={"PDSERVE_ADMIN_API_KEY": "sk-admin-env"})
    assert len(admin.key_digests) == 1
    # a client key's variables are never an admin key's
    assert not admin_auth_from_args(parse(), environ={"PDSERVE_API_KEY": "sk-a",
                                                      "VLLM_API_KEY": "sk-b"}).has_keys
    with pytest.raises(ValueError, match="^PDSERVE_ADMIN_API_KEY: the API key is empty"):
        admin_auth_from_args(parse(), environ={"PDSERVE_ADMIN_API_KEY": ""})
    client = api_auth_from_args(parse("--api-key", "sk-same"), environ={})
    with pytest.raises(ValueError, match="admin API key is also a client API key"):
        admin_auth_from_args(parse("--admin-api-key", "sk-same"), client, environ={})


@pytest.mark.parametrize("paths", ["/health,/admin/scale", "/metrics/targets", "/admin",
                                   "/admin/pools/x"])
def test_an_admin_endpoint_cannot_be_public(capsys, paths):
    with pytest.raises(SystemExit) as info:
        parse("--public-endpoints", paths)
    assert info.value.code == 2
    error = capsys.readouterr().err
    assert "argument --public-endpoints:" in error and "is an admin endpoint" in error
    with pytest.raises(ValueError, match="is an admin endpoint"):
        ApiKeyAuth.of([KEY], public_paths=paths.split(","))


@pytest.mark.parametrize("host, api_key, open_warning, admin_line", [
    ("0.0.0.0", None, True, "answer loopback clients only"),
    ("::", None, True, "answer loopback clients only"),
    ("10.1.2.3", None, True, "are unreachable"),
    ("10.1.2.3", "sk-a", False, "are unreachable"),
    ("127.0.0.1", None, False, "answer loopback clients only"),
    ("localhost", None, False, "answer loopback clients only"),
    ("::1", None, False, "answer loopback clients only"),
])
def test_start_up_says_what_is_exposed(caplog, host, api_key, open_warning, admin_line):
    api_auth = ApiKeyAuth.of([api_key]) if api_key else None
    with caplog.at_level("INFO", logger="pdserve.router.flags"):
        log_exposure(host, api_auth, AdminAuth(), "8000 (HTTP)")
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert bool(warnings) == open_warning
    if open_warning:
        assert "THE API IS OPEN" in warnings[0].getMessage() and host in warnings[0].getMessage()
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(infos) == 1 and admin_line in infos[0]
    caplog.clear()
    with caplog.at_level("INFO", logger="pdserve.router.flags"):
        log_exposure(host, api_auth, AdminAuth.of(["sk-admin"]))
    assert [r.levelname for r in caplog.records] == (["WARNING"] if open_warning else [])
