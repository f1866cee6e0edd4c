"""The shape and inputs the router's end-to-end tests share (``test_router_http.py``,
``test_router_prompts.py``): one prefill and one decode worker in this process on the
demo model, ``--disaggregation always``, prompts under ``LOCAL_THRESHOLD`` tokens
prefilled on the decode worker; ``PROMPT`` fills a block, so it is disaggregated."""

from __future__ import annotations

from inproc_cluster import in_process_cluster

MAX_MODEL_LEN = 256
LOCAL_THRESHOLD = 8  # prompts under 8 tokens are prefilled on the decode worker
PROMPT = "The quick brown fox jumps over the lazy dog and then it runs far away"
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me about the sea and the ships on it."}]


def router_cluster(folder):
    """``in_process_cluster`` in the shape above, under ``folder``."""
    return in_process_cluster(folder, MAX_MODEL_LEN, local_prefill_threshold=LOCAL_THRESHOLD,
                              disaggregation="always")
