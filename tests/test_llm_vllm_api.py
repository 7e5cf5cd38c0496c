"""A vLLM user's offline script on afd by changing the import: `from afd import LLM, SamplingParams`,
vLLM's keywords and outputs (request_id, n outputs, logprobs, chat), and one meaning for the seed."""

from __future__ import annotations

import json

import pytest

from afd import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams
from afd.engine.offline import OfflineRequest
from afd.entrypoints.llm_nodes import complete

PROMPTS = ["Experts are", "Attention is"]


@pytest.fixture(scope="module")
def llm():
    return LLM("demo")


def test_greedy_sampling_params_give_the_ids_path_s_tokens(llm):
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    assert all(isinstance(o, RequestOutput) and isinstance(o.outputs[0], CompletionOutput) for o in out)
    ids = llm.generate_ids([o.prompt_token_ids for o in out], 6)
    assert [o.outputs[0].token_ids for o in out] == ids
    assert [o.prompt for o in out] == PROMPTS
    assert out[0].prompt_token_ids == llm.tokenizer.encode(PROMPTS[0])
    c = out[0].outputs[0]
    assert c.text == llm.tokenizer.decode(c.token_ids) and c.finish_reason in ("stop", "length")
    assert c.logprobs is None and c.cumulative_logprob is None


def test_vllm_defaults_and_prompt_forms(llm):
    sp = SamplingParams()
    assert (sp.temperature, sp.max_tokens, sp.n, sp.top_k) == (1.0, 16, 1, 0)
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's older "no cut"
    ids = llm.tokenizer.encode(PROMPTS[0])
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    forms = [PROMPTS[0], {"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}, ids, [ids]]
    outs = [llm.generate(f, greedy)[0] for f in forms]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [PROMPTS[0], PROMPTS[0], None, None, None]
    (old,) = llm.generate(prompt_token_ids=[ids], sampling_params=greedy)  # vLLM's older keyword
    assert old.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_request_ids_are_unique_and_outputs_finished(llm):
    sp = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(PROMPTS, sp)
    second = llm.generate(PROMPTS, [sp, SamplingParams(temperature=0, max_tokens=1)])
    ids = [o.request_id for o in first + second]
    assert len(set(ids)) == 4 and all(isinstance(i, str) for i in ids)
    assert all(o.finished and o.outputs[0].finished() for o in first + second)
    assert len(second[1].outputs[0].token_ids) == 1


def test_n_gives_n_outputs_seeded_with_seed_plus_index(llm):
    (out,) = llm.generate(PROMPTS[0], SamplingParams(n=2, seed=11, max_tokens=5, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1]
    for j, c in enumerate(out.outputs):
        (alone,) = llm.generate(PROMPTS[0], SamplingParams(seed=11 + j, max_tokens=5, ignore_eos=True))
        assert c.token_ids == alone.outputs[0].token_ids
    assert out.outputs[0].token_ids != out.outputs[1].token_ids


def test_logprobs_as_vllm_shapes_them(llm):
    (out,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True))
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 4
    for tok, lps in zip(c.token_ids, c.logprobs):
        assert tok in lps and len(lps) == 2 and all(isinstance(v, Logprob) for v in lps.values())
        assert lps[tok].rank == 1  # greedy: the sampled token is the most likely, among the top 2
        assert sorted(v.rank for v in lps.values()) == [1, 2]
        assert lps[tok].decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
    assert c.cumulative_logprob == pytest.approx(sum(lps[t].logprob for t, lps in zip(c.token_ids, c.logprobs)))


def test_chat_renders_the_template(llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    sp = SamplingParams(temperature=0, max_tokens=3)
    (out,) = llm.chat(conv, sp)
    text = llm.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
    assert out.prompt == text and out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert (
        out.outputs[0].token_ids == llm.generate({"prompt_token_ids": out.prompt_token_ids}, sp)[0].outputs[0].token_ids
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    both = llm.chat([conv, parts], sp)
    assert len(both) == 2 and both[1].prompt == llm.tokenizer.apply_chat_template([conv[1]])
    (own,) = llm.chat(conv, sp, chat_template="{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    assert own.prompt == "Be brief.|Hi|" and llm.tokenizer.chat_template != "{% for m in messages %}"
    # a path that is not there is refused (as vLLM does), not rendered as the template's text for every chat
    with pytest.raises(ValueError, match="--chat-template no/such/template.jinja: no such file"):
        llm.chat(conv, sp, chat_template="no/such/template.jinja")


def test_stop_strings_and_stop_ids(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (full,) = llm.generate(PROMPTS[1], greedy)
    ids = full.outputs[0].token_ids
    (cut,) = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[ids[2]])
    )
    c = cut.outputs[0]
    assert c.token_ids == ids[: ids.index(ids[2]) + 1] and (c.finish_reason, c.stop_reason) == ("stop", ids[2])
    stop = llm.tokenizer.decode(ids[3:5])
    (s,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop))
    assert s.outputs[0].finish_reason == "stop" and s.outputs[0].stop_reason == stop
    assert stop not in s.outputs[0].text and full.outputs[0].text.startswith(s.outputs[0].text)


def test_node_outputs_complete_as_the_engine_does(llm):
    """A multi-process LLM's nodes return ids alone; afd.entrypoints.llm_nodes.complete applies the engine's
    stops, text and logprobs to them: the colocated engine's answer for the same tokens."""
    tok, sp = llm.tokenizer, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (full,) = llm.generate(PROMPTS[1], sp)
    ids = full.outputs[0].token_ids
    for kw in ({"stop": tok.decode(ids[3:5])}, {"stop_token_ids": [ids[4]]}, {"max_tokens": 3}):
        want = SamplingParams(**{**{"temperature": 0, "max_tokens": 8, "ignore_eos": True}, **kw})
        (ref,) = llm.generate(PROMPTS[1], want)
        req = OfflineRequest(full.prompt_token_ids, want.max_tokens, want.engine_params(None), want.stop_strings, True)
        got = complete(ids, req, tok, tok.eos_token_ids, None)
        r = ref.outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            r.token_ids,
            r.text,
            r.finish_reason,
            r.stop_reason,
        )


def test_max_model_len_cuts_the_output_and_refuses_a_prompt_past_it():
    small = LLM("demo", max_model_len=10)
    (out,) = small.generate([1, 2, 3, 4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len 10"):
        small.generate([list(range(1, 11))])


@pytest.mark.parametrize(
    "field,value",
    [
        ("best_of", 3),
        ("prompt_logprobs", 1),
        ("include_stop_str_in_output", True),
        ("bad_words", ["x"]),
    ],
)
def test_unsupported_sampling_field_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_values_are_checked_and_keywords_are_vllm_s(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="not both"):
        llm.generate(PROMPTS, SamplingParams(), max_tokens=3)
    with pytest.raises(ValueError, match="sampling_params for 2 prompts"):
        llm.generate(PROMPTS, [SamplingParams()])
    with pytest.raises(ValueError, match="max_token"):
        llm.generate(PROMPTS, max_token=3)  # a typo: ours, not a TypeError


def test_llm_keywords_vllm_s_and_afd_s():
    tp = LLM("demo", tensor_parallel_size=2, enforce_eager=True, trust_remote_code=True, gpu_memory_utilization=0.5)
    assert tp.config.layout.attention_tp == 2 and tp.cluster is not None and tp.cluster.layout.attention_tp == 2
    assert tp.config.layout.graph_mode == "eager" and tp._local is None  # nodes start with the first generate()
    assert LLM("demo", tensor_parallel_size=2, dtype="half").config.model.dtype == "float16"  # vLLM's spelling
    seeded = LLM("demo", seed=7, weights_seed=3, load_format="dummy")
    assert (seeded.config.engine.sampling_seed, seeded.config.model.seed) == (7, 3)
    assert seeded.config.model.dummy_weights and LLM("demo").config.engine.sampling_seed == 0  # vLLM's default
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM("demo", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_tokens"):
        LLM("demo", speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="unknown option.*'foo'"):
        LLM("demo", foo=1)


def test_llm_seed_seeds_the_sampling_of_unseeded_requests():
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    a, b, c = (LLM("demo", seed=s).generate(PROMPTS, sp) for s in (5, 5, 6))
    ids = [[o.outputs[0].token_ids for o in out] for out in (a, b, c)]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_generate_command_s_seed_seeds_sampling(tmp_path, capsys, monkeypatch):
    """`afd generate --seed` is serve's: the sampling seed; --weights-seed seeds the dummy weights."""
    from afd.entrypoints.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.json").write_text(json.dumps([[1, 2, 3], [4, 5]]))
    base = ["generate", "--model", "demo", "--prompt-ids", "p.json", "--max-tokens", "4", "--colocated"]

    def run(*extra: str) -> list:
        assert main([*base, "--ignore-eos", "--temperature", "1", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    seeded = run("--seed", "5")
    assert seeded == run("--seed", "5") != run("--seed", "6")
    assert seeded == LLM("demo").generate_ids([[1, 2, 3], [4, 5]], 4, temperature=1.0, seed=5, ignore_eos=True)
    assert run("--seed", "5", "--dummy-weights", "--weights-seed", "1") != run(
        "--seed", "5", "--dummy-weights", "--weights-seed", "2"
    )


@pytest.mark.slow
def test_on_node_processes_as_colocated(llm):
    """Multi-process: the same outputs (ids, text, stops, logprobs) as colocated, from one job per sampling."""
    sps = [
        SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[181]),
    ]
    want = llm.generate(PROMPTS, sps)
    with LLM("demo", attention_nodes=1, ffn_nodes=1) as nodes:
        got = nodes.generate(PROMPTS, sps)
    for w, g in zip(want, got):
        a, b = w.outputs[0], g.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.stop_reason,
        )
        if a.logprobs:
            assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs]
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


@pytest.mark.slow
def test_tensor_parallel_size_2_runs_as_colocated(llm):
    """vLLM's tensor_parallel_size=2: one attention node of two TP ranks (every expert on each), greedy
    tokens as colocated's."""
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    with LLM("demo", tensor_parallel_size=2) as tp:
        assert [o.outputs[0].token_ids for o in tp.generate(PROMPTS, sp)] == want


@pytest.mark.slow
def test_the_llms_seed_reaches_node_processes():
    """LLM(seed=...) seeds the attention node's default generator: requests without a seed of their own sample
    the same tokens from a new LLM with the same seed, and others from another seed."""
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def sampled(seed: int) -> list:
        with LLM("demo", attention_nodes=1, ffn_nodes=1, seed=seed) as nodes:
            return [o.outputs[0].token_ids for o in nodes.generate(PROMPTS, sp)]

    first = sampled(5)
    assert sampled(5) == first
    assert sampled(6) != first
