"""`afd serve` as a vLLM user runs it: a checkpoint directory, 2 attention + 1 FFN node, an API key
and a served model name, driven by the official OpenAI client; vLLM's extra endpoints and defaults."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import forked_python
import pytest
from cluster_helpers import ROOT, get, post
from serve_helpers import Served, free_port_run

pytestmark = pytest.mark.multiprocess
KEY = {"Authorization": "Bearer K"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from afd.model.demo import ensure_demo_checkpoint

    port = free_port_run(2)
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    s = Served(
        [
            ensure_demo_checkpoint(),
            "--attention-nodes",
            "2",
            "--ffn-nodes",
            "1",
            "--api-key",
            "K",
            "--served-model-name",
            "m",
            "--port",
            str(port),
            "--seed",
            "5",
        ],
        tmp_path_factory.mktemp("serve") / "serve.log",
        urls,
    )
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0


def test_every_attention_node_url_is_printed_and_serves(served):
    import time

    end = time.monotonic() + 10  # the launcher prints once it has seen every node healthy too
    while [ln for ln in served.log.read_text().splitlines() if ln.startswith("http://")] != served.urls:
        assert time.monotonic() < end, served.log.read_text()
        time.sleep(0.2)
    for url in served.urls:
        code, body = post(url, "/v1/completions", {"model": "m", "prompt": "Experts are", "max_tokens": 4}, KEY)
        assert code == 200 and body["model"] == "m", body


def test_the_tokenizer_routes_take_the_key_and_detokenize_the_contexts_bound(served):
    """/tokenize and /detokenize spend the server's CPU on a client's input as completions do: keyed, and
    /detokenize bounded as /tokenize is, by what one context holds (15M ids took 1.2 GB unbounded)."""
    url = served.urls[0]
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        code, err = post(url, path, body)
        assert code == 401 and err["error"]["code"] == 401, (path, err)
        assert post(url, path, body, KEY)[0] == 200, path
    longest = post(url, "/tokenize", {"prompt": "hi"}, KEY)[1]["max_model_len"]
    assert post(url, "/detokenize", {"tokens": [1] * longest}, KEY)[0] == 200
    code, err = post(url, "/detokenize", {"tokens": [1] * (longest + 1)}, KEY)
    assert code == 400 and err["error"]["param"] == "tokens", err
    assert f"maximum context length is {longest} tokens" in err["error"]["message"], err
    assert get(url, "/health")[0] == 200 and get(url, "/ping")[0] == 200  # probes need no key


def test_completions_default_to_16_tokens(served):
    code, body = post(served.urls[0], "/v1/completions", {"prompt": "Experts are", "ignore_eos": True}, KEY)
    assert code == 200 and body["usage"]["completion_tokens"] == 16, body


def test_tokenize_detokenize_and_ping(served):
    url = served.urls[1]
    code, tok = post(url, "/tokenize", {"prompt": "Experts are", "return_token_strs": True}, KEY)
    assert code == 200 and tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 1
    code, detok = post(url, "/detokenize", {"tokens": tok["tokens"]}, KEY)
    assert code == 200 and detok["prompt"] == "Experts are"
    code, err = post(url, "/detokenize", {"tokens": [10**9]}, KEY)
    assert code == 400 and err["error"]["param"] == "tokens"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    assert post(url, "/tokenize", parts, KEY)[1]["tokens"] == post(url, "/tokenize", plain, KEY)[1]["tokens"]
    assert get(url, "/ping")[0] == 200
    req = urllib.request.Request(url + "/ping", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def test_the_official_openai_client(served):
    import openai

    client = openai.OpenAI(base_url=served.urls[0] + "/v1", api_key="K", max_retries=0)
    assert [m.id for m in client.models.list()] == ["m"]
    c = client.completions.create(model="m", prompt="Experts are", max_tokens=6, temperature=0)
    assert c.choices[0].text and c.usage.completion_tokens <= 6
    chat = client.chat.completions.create(
        model="m",
        max_tokens=6,
        temperature=0,
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
    )
    full = chat.choices[0].message.content
    stream = client.chat.completions.create(
        model="m",
        max_tokens=6,
        temperature=0,
        stream=True,
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == full
    seeded = [
        client.completions.create(model="m", prompt="Experts are", max_tokens=6, n=2, seed=11, temperature=1.0)
        for _ in range(2)
    ]
    texts = [[ch.text for ch in sorted(r.choices, key=lambda x: x.index)] for r in seeded]
    assert texts[0] == texts[1] and len(texts[0]) == 2
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="m", prompt="Experts are", max_tokens=10**7)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Experts are", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.urls[0] + "/v1", api_key="wrong", max_retries=0).completions.create(
            model="m", prompt="x", max_tokens=2
        )


def test_afd_bench_takes_its_prompt_ids_from_the_servers_vocabulary(served):
    """Without --vocab-size (the README's line): ids come from what /v1/models says, so none is refused."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "afd",
            "bench",
            "--base-url",
            served.urls[0],
            "--num-prompts",
            "6",
            "--random-input-len",
            "32",
            "--random-output-len",
            "4",
            "--disable-tqdm",
            "--api-key",
            "K",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Successful requests:                     6" in r.stdout, r.stdout


def _afd(*argv: str) -> subprocess.CompletedProcess:
    return forked_python.run([sys.executable, "-m", "afd", *argv], cwd=ROOT, timeout=180)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["serve", "demo", "--colocated", "--attention-nodes", "2"], "--colocated runs both halves in one process"),
        (["serve", "/nowhere"], "/nowhere: not a checkpoint directory"),
        (["serve", "demo", "--max-num-seqs", "0"], "must be positive, got 0"),
        (
            [
                "generate",
                "--model",
                "demo",
                "--prompt-ids",
                "x.json",
                "--max-tokens",
                "2",
                "--colocated",
                "--attention-nodes",
                "2",
            ],
            "--colocated runs both halves in this process",
        ),
    ],
)
def test_serve_refuses_bad_flags_in_one_line(argv, message):
    r = _afd(*argv)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_absent_device_is_one_line_everywhere(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    ids = tmp_path / "p.json"
    ids.write_text("[[1, 2, 3]]")
    for argv in (
        ["serve", "demo", "--device", "cuda"],
        [
            "generate",
            "--model",
            "demo",
            "--prompt-ids",
            str(ids),
            "--max-tokens",
            "2",
            "--colocated",
            "--device",
            "cuda",
        ],
    ):
        r = _afd(*argv)
        assert r.returncode == 2 and "no CUDA device is visible" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_generate_takes_model_demo(tmp_path):
    ids = tmp_path / "p.json"
    ids.write_text(json.dumps([[1, 42, 93]]))
    r = _afd("generate", "--model", "demo", "--prompt-ids", str(ids), "--max-tokens", "3", "--colocated")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.splitlines()[-1])[0]) == 3


@pytest.mark.parametrize("command", ["serve", "launch", "bench", "generate", "bench-step"])
def test_help_shows_every_default(command):
    import re

    r = _afd(command, "--help")
    assert r.returncode == 0
    options: list[str] = []  # one entry per option: its line and the help lines under it
    for line in r.stdout.split("options:", 1)[1].splitlines():
        if re.match(r"  -", line):
            options.append(line.strip())
        elif options:
            options[-1] += " " + line.strip()
    for flag, default in re.findall(
        r"p\.add_argument\(\"(--[a-z-]+)\"[^)]*?default=([0-9.]+|\"[^\"]+\")", _sources(command)
    ):
        for seg in [o for o in options if o.startswith(flag + " ") or o == flag]:  # (a file may hold more commands)
            assert "(default: " in seg, (flag, default, seg)


def _sources(command: str) -> str:
    files = {
        "serve": "afd/entrypoints/serve.py",
        "launch": "afd/entrypoints/launch.py",
        "bench": "afd/bench/serve.py",
        "generate": "afd/entrypoints/cli.py",
        "bench-step": "afd/bench/step.py",
    }
    return (ROOT / files[command]).read_text()
