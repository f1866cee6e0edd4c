"""The engine thread: concurrent streams, aborts, early consumer exit, failures."""

from __future__ import annotations

import asyncio

import pytest
from conftest import random_prompts

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError, _Command

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def async_engine(tiny_checkpoints):
    engine = LLMEngine(EngineConfig(str(tiny_checkpoints["llama"]), dtype="float32",
                                    max_model_len=256, load_progress=False))
    runner = AsyncEngine(engine)
    runner.start()
    yield runner
    runner.shutdown()


async def collect(runner, request_id, prompt, params=PARAMS):
    tokens = []
    async for out in runner.generate(request_id, prompt, params, timeout_s=30):
        tokens += out.new_token_ids
        last = out
    return tokens, last


def test_concurrent_streams_match_sequential(async_engine):
    prompts = random_prompts([5, 20, 33], seed=21)

    async def main():
        together = await asyncio.gather(*(collect(async_engine, f"c{i}", p)
                                          for i, p in enumerate(prompts)))
        alone = [await collect(async_engine, f"s{i}", p) for i, p in enumerate(prompts)]
        return together, alone

    together, alone = asyncio.run(main())
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert all(last.finish_reason == "length" for _, last in together)
    assert async_engine.engine.is_idle_and_clean()


def test_abort_and_early_exit_free_blocks(async_engine):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = async_engine.generate("abort-me", [1, 2, 3], long, timeout_s=30)
        first = await stream.__anext__()
        assert not first.finished
        assert await async_engine.abort("abort-me")
        rest = [o async for o in stream]
        assert rest[-1].finish_reason == "abort"

        early = async_engine.generate("leave-early", [4, 5, 6], long, timeout_s=30)
        await early.__anext__()
        await early.aclose()  # the consumer goes away: the request is aborted
        return await async_engine.call(lambda e: e.is_idle_and_clean())

    assert asyncio.run(main())


def test_bad_request_raises_and_dead_engine_refuses(tiny_checkpoints):
    engine = LLMEngine(EngineConfig(str(tiny_checkpoints["llama"]), dtype="float32",
                                    max_model_len=64, load_progress=False))
    runner = AsyncEngine(engine)
    runner.start()

    async def main():
        with pytest.raises(ValueError, match="maximum model length"):
            await collect(runner, "big", [1] * 100)
        runner.shutdown()
        with pytest.raises(EngineDeadError):
            await collect(runner, "late", [1, 2])

    asyncio.run(main())


def test_caller_loop_gone_does_not_kill_the_engine_thread(async_engine):
    """A caller whose event loop closed before its result came back (a test or a server
    torn down mid-call) must not take the engine thread with it."""
    import time

    loop = asyncio.new_event_loop()
    future = loop.create_future()
    loop.close()
    async_engine._commands.put(_Command(lambda e: time.sleep(0.05), None, loop, future))
    async_engine._wake.set()
    time.sleep(0.3)
    assert async_engine.alive

    async def main():
        return await collect(async_engine, "after", [1, 2, 3])

    tokens, last = asyncio.run(main())
    assert len(tokens) == 8 and last.finished


def test_a_command_whose_caller_left_before_it_ran_is_dropped(async_engine):
    """STYLE.md 12: a queued command carries its caller's cancellation."""
    import threading
    import time

    ran = threading.Event()

    async def main():
        blocker = asyncio.ensure_future(async_engine.call(lambda e: time.sleep(0.3)))
        await asyncio.sleep(0.05)  # the engine thread is inside the blocker now
        late = asyncio.ensure_future(async_engine.call(lambda e: ran.set()))
        await asyncio.sleep(0.05)
        late.cancel()
        await blocker
        await async_engine.call(lambda e: None)  # everything queued before it has run

    asyncio.run(main())
    assert not ran.is_set()


def test_a_command_whose_caller_left_while_it_ran_is_undone(async_engine):
    import time

    undone = []

    async def main():
        call = asyncio.ensure_future(async_engine.call(
            lambda e: (time.sleep(0.2), "result")[1], undo=lambda e, r: undone.append(r)))
        await asyncio.sleep(0.05)  # running now
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.3)
        await async_engine.call(lambda e: None)  # the undo was posted before this

    asyncio.run(main())
    assert undone == ["result"]


def test_a_timed_out_call_is_undone(async_engine):
    import time

    undone = []

    async def main():
        with pytest.raises(TimeoutError):
            await async_engine.call(lambda e: (time.sleep(0.2), 7)[1], timeout_s=0.05,
                                    undo=lambda e, r: undone.append(r))
        await asyncio.sleep(0.3)
        await async_engine.call(lambda e: None)

    asyncio.run(main())
    assert undone == [7]


@pytest.mark.parametrize("delay_s", [0.0, 0.001, 0.005, 0.02, 0.05])
def test_generate_cancelled_at_any_point_leaves_nothing(async_engine, delay_s):
    """Cancel a stream while it is being added, in its first step, or later: the engine
    ends idle with every block free and none owned by nothing."""
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def consume(i):
        async for _ in async_engine.generate(f"cancel-{delay_s}-{i}", [1, 2, 3] * (i + 1), long):
            pass

    async def main():
        tasks = [asyncio.ensure_future(consume(i)) for i in range(8)]
        await asyncio.sleep(delay_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await async_engine.call(lambda e: None)
        return await async_engine.call(lambda e: (e.is_idle_and_clean(),
                                                  e.num_unowned_blocks()))

    assert asyncio.run(main()) == (True, 0)


def test_build_makes_the_engine_on_the_thread_that_steps_it(tiny_checkpoints):
    import threading

    made_on = []

    def factory():
        made_on.append(threading.get_ident())
        return LLMEngine(EngineConfig(str(tiny_checkpoints["llama"]), dtype="float32",
                                      max_model_len=256, load_progress=False))

    runner = AsyncEngine.build(factory, name="built-engine")
    try:
        async def main():
            stepped_on = await runner.call(lambda e: threading.get_ident())
            tokens, last = await collect(runner, "built", [1, 2, 3])
            return stepped_on, tokens, last
        stepped_on, tokens, last = asyncio.run(main())
        assert made_on == [stepped_on] and stepped_on != threading.get_ident()
        assert len(tokens) == PARAMS.max_tokens and last.finish_reason == "length"
    finally:
        runner.shutdown()
    assert not runner.alive


def test_a_failed_build_raises_its_error_and_leaves_no_thread():
    import threading

    def factory():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(factory, name="failed-engine")
    assert not any(t.name == "failed-engine" for t in threading.enumerate())
