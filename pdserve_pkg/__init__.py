"""pdserve: a disaggregated prefill/decode LLM serving cluster.

The subpackages map one-to-one onto the repository's top-level folders
(``pdserve.engine`` is ``engine/``, and so on; see docs/architecture.md, Layout).
"""

__version__ = "0.1.0"
