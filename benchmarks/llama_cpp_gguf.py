"""GGUF files of a Hugging Face Llama folder for ``peers.py``'s llama.cpp rows.

``convert(...)`` runs llama.cpp's ``convert_hf_to_gguf.py`` through a small wrapper that
fixes the two places where it stops on W1's model:

- its demo tokenizer has no pre-tokenizer hash the converter knows; it splits like
  ``llama-bpe`` (a byte-level BPE with GPT-2's regex), so an unknown hash becomes that;
- without the ``sentencepiece`` package the converter's first try (a SentencePiece
  ``tokenizer.model``, which W1 has not) fails with ``ModuleNotFoundError`` instead of
  ``FileNotFoundError``; the wrapper turns it into the latter, so the converter goes on to
  ``tokenizer.json``.

The converter writes ``q8_0`` (and ``bf16``, ``f16``, ``f32``) itself; ``q4_0`` comes from
``llama-quantize`` on a ``bf16`` file, as llama.cpp's own instructions do it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TIMEOUT_S = 1800.0

WRAPPER = textwrap.dedent('''\
    import runpy, sys
    from pathlib import Path
    convert = Path(sys.argv[1])
    sys.path.insert(0, str(convert.parent))
    sys.path.insert(1, str(convert.parent / "gguf-py"))
    from conversion import base
    _pre = base.TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return _pre(self, tokenizer)
        except NotImplementedError:
            return "llama-bpe"
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        def no_sentencepiece(self):
            raise FileNotFoundError("sentencepiece is not installed")
        base.TextModel._set_vocab_sentencepiece = no_sentencepiece
    sys.argv = sys.argv[1:]
    runpy.run_path(str(convert), run_name="__main__")
''')


def convert(convert_script: Path, model: Path, outtype: str, outfile: Path,
            quantize: Path | None = None) -> Path:
    """``outfile`` (kept if already there): ``model`` in GGUF, its linear layers in
    ``outtype`` (``q8_0``, ``q4_0``, ``bf16``...). ``q4_0`` needs ``quantize`` (the
    ``llama-quantize`` binary) and goes through a ``bf16`` file beside ``outfile``.

    Raises:
        subprocess.CalledProcessError: the converter or ``llama-quantize`` failed.
    """
    if outfile.is_file():
        return outfile
    outfile.parent.mkdir(parents=True, exist_ok=True)
    if outtype.lower() in ("q8_0", "bf16", "f16", "f32"):
        subprocess.run([sys.executable, "-c", WRAPPER, str(convert_script), str(model),
                        "--outtype", outtype.lower(), "--outfile", str(outfile)],
                       check=True, timeout=TIMEOUT_S)
        return outfile
    if quantize is None:
        raise ValueError(f"{outtype} needs llama-quantize")
    source = convert(convert_script, model, "bf16",
                     outfile.with_name(outfile.stem + ".bf16.gguf"))
    subprocess.run([str(quantize), str(source), str(outfile), outtype.upper()], check=True,
                   timeout=TIMEOUT_S)
    return outfile
