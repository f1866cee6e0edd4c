"""Speculative decoding with n-gram proposals (issue 28; ``engine/spec_decode.py``): greedy
output equal to decoding one token at a time for every family and k in {1, 3, 5}
(chunked prefill, tensor parallelism and a disaggregated decode worker included), the
rejection sampler following the target distribution, seeded requests repeating, the
proposer, the flag's refusals, and the acceptance counters on ``/metrics``.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import random_prompts
from test_families import BASE, FAMILIES, checkpoints  # noqa: F401 - the module's fixture

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.demo_model import VOCAB_SIZE
from pdserve.engine.request import Request
from pdserve.engine.spec_decode import SpeculativeConfig, ngram_propose, verify
from pdserve.engine.suffix_decoding import SuffixIndex, SuffixProposer, SuffixSettings

NEW_TOKENS = 24


def spec(k: int, method: str = "ngram", draft: str | None = None) -> dict:
    if method == "draft_model":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k,
                "suffix_decoding_max_tree_depth": 12, "suffix_decoding_max_spec_factor": 2.0,
                "suffix_decoding_min_token_prob": 0.05}
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}


def repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat themselves (as a code edit repeats its file), and a random one."""
    pieces = random_prompts([6, 11, 9], vocab_size=VOCAB_SIZE, seed=8)
    return [pieces[0] * 4, pieces[1] * 3 + pieces[2], *random_prompts([30], VOCAB_SIZE, 9)]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict:
    """Each family's draft model: the same family and tokenizer, 2 layers instead of 4,
    its own random weights (so it proposes well sometimes, and badly often)."""
    root = tmp_path_factory.mktemp("drafts")
    made = {}
    for name, (config_cls, model_cls, extra) in FAMILIES.items():
        fields = {**BASE, **extra, "num_hidden_layers": 2}
        if "layer_types" in fields:
            fields["layer_types"] = fields["layer_types"][:2]
        torch.manual_seed(1)
        config = getattr(transformers, config_cls)(**fields)
        getattr(transformers, model_cls)(config).eval().save_pretrained(root / name)
        made[name] = root / name
    return made


@pytest.fixture(scope="module")
def reference(checkpoints):  # noqa: F811
    """Each family's tokens and logprobs decoding one token at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=2)
    made = {}
    for family, path in checkpoints.items():
        llm = LLM(str(path), dtype="float32", load_progress=False, max_model_len=256)
        made[family] = llm.generate(repetitive_prompts(), params)
    return made


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_decoding_one_token_at_a_time(family, k, method, checkpoints,  # noqa: F811
                                                    drafts, reference):
    llm = LLM(str(checkpoints[family]), dtype="float32", load_progress=False,
              max_model_len=256, max_num_batched_tokens=24,
              speculative_config=spec(k, method, str(drafts[family])))
    outputs = llm.generate(repetitive_prompts(), SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2))
    for out, ref in zip(outputs, reference[family]):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for step, ref_step in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert step.keys() == ref_step.keys()
            for token, lp in step.items():
                assert lp.logprob == pytest.approx(ref_step[token].logprob, abs=1e-4)
    scheduler = llm.engine.scheduler
    # proposals were made, and some stood (a random draft's may all fall: the self-draft
    # test below has every one stand)
    assert scheduler.num_draft_tokens_total > 0
    if method != "draft_model":
        assert scheduler.num_accepted_tokens_total > 0
    assert scheduler.num_accepted_tokens_total <= scheduler.num_draft_tokens_total
    assert llm.engine.is_idle_and_clean()


def test_greedy_speculation_under_tensor_parallelism(checkpoints, reference):  # noqa: F811
    llm = LLM(str(checkpoints["qwen2"]), dtype="float32", load_progress=False,
              max_model_len=256, tensor_parallel_size=2, speculative_config=spec(3))
    try:
        outputs = llm.generate(repetitive_prompts(), SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outputs] == \
            [r.outputs[0].token_ids for r in reference["qwen2"]]
        assert llm.engine.scheduler.num_accepted_tokens_total > 0
    finally:
        llm.shutdown()


def test_a_draft_model_that_is_the_target_has_every_proposal_accepted(checkpoints):  # noqa: F811
    """The draft's own KV cache (its catch-up over the prompt, the one-token passes, the
    rollback to the verified tokens) is right: the target as its own draft agrees with
    itself on every proposal, through chunked prefill and preemption."""
    path = str(checkpoints["llama32"])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = repetitive_prompts()
    expected = LLM(path, dtype="float32", load_progress=False,
                   max_model_len=256).generate(prompts, params)
    llm = LLM(path, dtype="float32", load_progress=False, max_model_len=128,
              max_num_batched_tokens=24, num_gpu_blocks_override=8,
              speculative_config=spec(4, "draft_model", path))
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == \
        [o.outputs[0].token_ids for o in expected]
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions_total > 0
    assert scheduler.num_draft_tokens_total > 0
    assert scheduler.num_accepted_tokens_total == scheduler.num_draft_tokens_total
    assert llm.engine.draft_proposer.draft_computed == {}  # forgotten as requests ended


def test_the_rejection_sampler_follows_the_target_distribution():
    """One proposal, deterministic (its own probability 1), over a 6-token vocabulary:
    the first output token is distributed as the target's first row, and the bonus
    token (the proposal stood) as its second; the total variation distance shrinks as
    the sample count grows (vLLM's test_rejection_sampler does the same)."""
    probs = torch.tensor([[0.05, 0.40, 0.10, 0.25, 0.15, 0.05],
                          [0.30, 0.05, 0.05, 0.20, 0.10, 0.30]])
    logits = probs.log()
    request = Request("r", [1, 2, 3], SamplingParams(temperature=1.0), frozenset(), 100)
    generator = torch.Generator().manual_seed(1234)
    first, bonus = torch.zeros(6), torch.zeros(6)
    distances = {}
    drawn = 0
    for total in (400, 4000, 40000):
        while drawn < total:
            out = verify(probs, logits, [1], request, generator)
            first[out[0]] += 1
            if len(out) == 2:
                bonus[out[1]] += 1
            drawn += 1
        distances[total] = 0.5 * float((first / first.sum() - probs[0]).abs().sum())
    assert distances[40000] < distances[4000] < distances[400]
    assert distances[40000] < 0.01
    assert bonus.sum() == pytest.approx(0.40 * 40000, rel=0.05)  # the proposal stood
    assert 0.5 * float((bonus / bonus.sum() - probs[1]).abs().sum()) < 0.02


def test_a_seeded_speculating_request_repeats_exactly(checkpoints):  # noqa: F811
    llm = LLM(str(checkpoints["llama32"]), dtype="float32", load_progress=False,
              max_model_len=256, speculative_config=spec(3))
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=NEW_TOKENS,
                            ignore_eos=True)
    prompts = repetitive_prompts()
    alone = llm.generate(prompts[:1], seeded)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True)
    batched = llm.generate(prompts, [seeded, unseeded, unseeded])[0].outputs[0].token_ids
    assert alone == batched
    assert llm.engine.scheduler.num_drafts_total > 0


def test_the_ngram_proposer_takes_the_longest_latest_match():
    assert ngram_propose([1, 2, 3, 9, 1, 2], 2, 2, 1) == [3, 9]
    assert ngram_propose([1, 2, 3, 9, 1, 2], 5, 2, 1) == [3, 9, 1, 2]
    assert ngram_propose([4, 1, 5, 2, 1], 2, 3, 1) == [5, 2]  # "1" at 1 is the latest
    assert ngram_propose([7, 1, 8, 1], 2, 3, 2) == []  # no 2-gram repeats
    assert ngram_propose([1, 2, 1, 2, 1, 2], 3, 4, 1) == [1, 2]  # "2 1 2" at 1: then 1, 2
    assert ngram_propose([5], 3, 3, 1) == []


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle3", "num_speculative_tokens": 3}', "method='eagle3'"),
    ('{"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 1}',
     "suffix_decoding_"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "modell": "x"}', "unknown key 'modell'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "for method draft_model"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "for method draft_model"),
    ('{"method": "ngram"}', "needs method and num_speculative_tokens"),
    (('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
      '"prompt_lookup_max": 2}'), "prompt_lookup_min=4"),
    ("ngram", "not JSON"),
])
def test_bad_speculative_configs_are_refused_naming_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_speculation_turns_off_at_disable_by_batch_size(checkpoints):  # noqa: F811
    """vLLM's ``disable_by_batch_size``: no proposals while that many requests run (W1's
    batch of 32 on a CPU step is bound by compute, where rejected rows are lost work)."""
    llm = LLM(str(checkpoints["llama32"]), dtype="float32", load_progress=False,
              max_model_len=256, speculative_config={**spec(3), "disable_by_batch_size": 3})
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(repetitive_prompts(), params)  # three at once: never proposes
    assert llm.engine.scheduler.num_drafts_total == 0
    llm.generate(repetitive_prompts()[:2], params)
    assert llm.engine.scheduler.num_drafts_total > 0


def test_the_suffix_index_counts_substrings_and_forgets_a_removed_sequence():
    index = SuffixIndex(depth=3)
    index.extend("a", [1, 2, 3])
    index.extend("a", [1, 2])  # appended as it decodes: 1 2 3 1 2
    node, length = index.match([9, 1, 2])
    assert length == 2 and node.count == 2  # "1 2" twice
    assert {t: c.count for t, c in node.children.items()} == {3: 1}  # depth 3: "1 2 3"
    index.extend("b", [5, 1, 2])
    assert index.match([1, 2])[0].count == 3
    index.remove("a")
    assert index.match([1, 2])[0].count == 1 and index.match([3])[0] is None
    index.remove("b")
    assert index.root.children == {}


def test_suffix_proposals_come_from_the_request_and_from_finished_requests():
    proposer = SuffixProposer(SuffixSettings(max_tree_depth=6, max_cached_requests=1))
    assert proposer.propose("r", [4, 5, 6, 7, 4, 5], 4) == [6, 7]  # its own tokens
    proposer.finish("r", [4, 5, 6, 7, 4, 5, 6, 7, 8])
    # r's tokens continue another request's; "6 7 8" ended r: nothing follows it
    assert proposer.propose("s", [1, 6, 7, 8], 3) == []
    # as many as the match is long (max_spec_factor 1): "5 6" -> "7 4"
    assert proposer.propose("t", [9, 5, 6], 3) == [7, 4]
    proposer.finish("u", [30, 31])  # past max_cached_requests: r leaves the index
    assert proposer.propose("v", [9, 5, 6], 3) == []
    proposer.finish("t", [])  # an aborted request: its own index goes, nothing cached


def test_an_agent_loop_repeats_itself_and_suffix_decoding_accepts_it(checkpoints):  # noqa: F811
    """The same request again (an agent's next turn over the same tool output): its
    output is proposed from the first one's, and nearly every proposal stands."""
    llm = LLM(str(checkpoints["mistral"]), dtype="float32", load_progress=False,
              max_model_len=256, speculative_config=spec(5, "suffix"))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = random_prompts([40], VOCAB_SIZE, seed=12)
    first = llm.generate(prompt, params)[0].outputs[0].token_ids
    scheduler = llm.engine.scheduler
    proposed, accepted = scheduler.num_draft_tokens_total, scheduler.num_accepted_tokens_total
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == first
    assert scheduler.num_accepted_tokens_total - accepted >= NEW_TOKENS // 2
    assert (scheduler.num_accepted_tokens_total - accepted) / (
        scheduler.num_draft_tokens_total - proposed) > 0.8


def test_vllm_defaults_for_the_lookup_window():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (config.prompt_lookup_max, config.prompt_lookup_min) == (5, 5)
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                      "prompt_lookup_max": 3})
    assert (config.prompt_lookup_max, config.prompt_lookup_min) == (3, 3)


DISAGGREGATED = [(family, ("ngram", "suffix", "draft_model")[i % 3], (1, 3, 5)[i % 3])
                 for i, family in enumerate(FAMILIES)]


@pytest.mark.parametrize("family, method, k", DISAGGREGATED)
def test_a_disaggregated_decode_worker_speculates_and_counts_on_metrics(
        tmp_path, checkpoints, family, method, k):  # noqa: F811
    """Each family served disaggregated, the decode worker speculating (the methods and
    k in turn; a draft model computes its own KV of the prompt the prefill worker sent):
    the offline engine's greedy text, and ``/metrics`` counters that are its
    scheduler's."""
    from inproc_cluster import in_process_cluster
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.cluster.worker_metrics import WorkerCollector

    model = checkpoints[family]  # NOTE: its own draft, for draft_model
    prompt = "the cat sat on the mat and the cat sat on the mat and the cat sat on the"
    with in_process_cluster(tmp_path, 256, model=model, disaggregation="always",
                            local_prefill_threshold=4, decode_engine={
                                "speculative_config": spec(k, method, str(model))}) as cluster:
        reply = cluster.client().completions.create(
            model=str(cluster.model), prompt=prompt, max_tokens=64, temperature=0.0,
            extra_body={"ignore_eos": True})
        assert reply.choices[0].text == cluster.expected(prompt, temperature=0.0,
                                                         max_tokens=64, ignore_eos=True)
        assert cluster.prefill_paths().get("remote", 0) >= 1
        scheduler = cluster.decode.runtime.engine.engine.scheduler
        assert scheduler.num_drafts_total > 0
        registry = CollectorRegistry()  # NOTE: what the worker's /metrics serves
        registry.register(WorkerCollector(cluster.decode.runtime,
                                          cluster.decode.receiver.counters))
        text = generate_latest(registry).decode()
        for name, value in (("num_drafts", scheduler.num_drafts_total),
                            ("num_draft_tokens", scheduler.num_draft_tokens_total),
                            ("num_accepted_tokens", scheduler.num_accepted_tokens_total)):
            line = next(line for line in text.splitlines()
                        if line.startswith(f"vllm:spec_decode_{name}_total{{"))
            assert float(line.rsplit(" ", 1)[1]) == value
        cluster.wait_all_blocks_free()


def test_a_draft_of_another_vocabulary_is_refused(checkpoints, tmp_path):  # noqa: F811
    from pdserve.engine.config import UnsupportedModelError

    config = transformers.LlamaConfig(**{**BASE, "vocab_size": BASE["vocab_size"] + 7})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "other")
    with pytest.raises(UnsupportedModelError, match="vocab_size=.* is not the target's"):
        LLM(str(checkpoints["llama32"]), dtype="float32", load_progress=False,
            max_model_len=256, speculative_config=spec(2, "draft_model",
                                                       str(tmp_path / "other")))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_structured_output_speculates_with_its_grammar_checking_the_proposals(tmp_path,
                                                                              method):
    """A JSON-schema request speculates: its grammar cuts the proposals at the first
    token it forbids and masks each verification row as that position's step would, so
    greedy output is one-token decoding's and sampled output always validates."""
    import json

    from test_structured_output import SCHEMAS

    from pdserve.engine.demo_model import make_demo_model
    from pdserve.engine.structured_output import json_schema_spec

    demo = str(make_demo_model(tmp_path / "demo"))
    prompts = [f"Request {i}: answer in JSON, then answer in JSON again." for i in range(6)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=200,
                             structured_output=json_schema_spec(SCHEMAS[i % 4]))
              for i in range(6)]
    expected = LLM(demo, dtype="float32", load_progress=False,
                   max_model_len=512).generate(prompts, greedy)
    llm = LLM(demo, dtype="float32", load_progress=False, max_model_len=512,
              speculative_config={**spec(4, method), "disable_by_batch_size": 64})
    outputs = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outputs] == \
        [o.outputs[0].token_ids for o in expected]
    scheduler = llm.engine.scheduler
    assert scheduler.num_accepted_tokens_total > 0
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=200,
                              structured_output=json_schema_spec(SCHEMAS[i % 4]))
               for i in range(24)]
    compiler = llm.engine.grammar_compiler()
    for params, output in zip(sampled, llm.generate(prompts * 4, sampled)):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"
        # NOTE: replayed through a fresh matcher, not jsonschema: with the demo model's
        # byte tokens xgrammar's maxLength and jsonschema's can disagree, speculation or
        # not (prompt 22 of these, seed 22: the same text either way)
        matcher = compiler.matcher(params.structured_output)
        assert all(matcher.accept(t) for t in completion.token_ids), completion.text
        assert json.loads(completion.text) is not None
    assert llm.engine.is_idle_and_clean()
