"""Model services in the protocols RL frameworks already call (``server/modelapi/``): SGLang's
``/generate``, OpenAI's API through the official ``openai`` SDK, vLLM's ``/classify`` and
``/pooling``, SGLang's ``/v1/embeddings``, OpenRLHF's and slime's reward batches; generation
checked against transformers, log-probabilities against the native API; quotas; bad input.

A live server on 127.0.0.1 (uvicorn in a thread, the app ``tangram serve`` builds with the model
protocols configured) over tiny Llama, Qwen2 and Qwen2 reward models with random weights and a
tokenizer of their own (``modelapi_fixtures.py``), on CPU devices."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from arl_tangram.managers.models.spec import ModelServiceConfig as M  # noqa: E402

from modelapi_fixtures import EOS, save_model  # noqa: E402

FREE, LIMITED = "free-key-0123456789abcdef", "limited-key-0123456789abcdef"
TOKEN = "the-servers-token-0123456789"
SEQS = [[5, 17, 3, 88, 41], [9, 2, 30], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7]]


class Live:
    """``app`` served by uvicorn on a free loopback port, in a thread of this process."""

    def __init__(self, app) -> None:
        import uvicorn

        from arl_tangram.bench.server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("modelapi")
    return {"llama": save_model(root / "llama", "llama", seed=1), "qwen2": save_model(root / "qwen2", "qwen2", seed=2),
            "rm": save_model(root / "rm", "qwen2-rm", seed=3), "bare": save_model(root / "bare", "llama", seed=4,
                                                                                  tokenizer_too=False)}


@pytest.fixture(scope="module")
def server(dirs):
    from arl_tangram.runtime import LocalRuntime
    from arl_tangram.server import modelapi
    from arl_tangram.server.app import create_app
    from arl_tangram.server.calls import with_dialects
    from arl_tangram.server.service import Service

    models = [M("llama", hf=dirs["llama"], task="logprobs", max_wait_ms=30, max_batch=8),
              M("qwen2", hf=dirs["qwen2"], task="logprobs", max_wait_ms=30, max_batch=8),
              M("rm", hf=dirs["rm"], task="score", max_wait_ms=30), M("bare", hf=dirs["bare"], task="logprobs")]
    config = modelapi.ModelApiConfig(
        quotas=[{"job": "limited", "model": "*", "requests_per_minute": 3},
                {"job": "limited", "model": "rm", "tokens_per_minute": 5}],
        reward_routes=[{"path": "/openrlhf/reward", "model": "rm", "shape": "openrlhf"},
                       {"path": "/slime/rm", "model": "rm", "shape": "slime"}])
    dialects = with_dialects(settings={"modelapi": config.model_dump()})  # as tangram serve's [model_api]
    service = Service(LocalRuntime(sandboxes=False, models=models, model_device="cpu"))
    live = Live(create_app(service, token=TOKEN, keys={FREE: "free", LIMITED: "limited"}, dialects=dialects))
    live.dirs = dirs
    yield live
    live.stop()


def post(server, path: str, body: dict, key: str = FREE) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def native_logprobs(server, model: str, tokens: list[int]) -> list[float]:
    r = post(server, f"/v1/models/{model}/logprobs", {"tokens": tokens})
    assert r.status_code == 200 and r.json()["outcome"] == "ok", r.text
    return r.json()["value"]


def openai_client(server, key: str = FREE, base: str = "/v1"):
    import openai

    return openai.OpenAI(base_url=server.url + base, api_key=key, max_retries=0, timeout=60)


def reference_generate(path: str, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


# -- log-probabilities: the native API's numbers through every protocol ---------------------------

@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_prompt_logprobs_through_generate_and_completions_equal_the_native_apis(server, model):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # at once: batched with each other
        sglang = list(pool.map(lambda s: post(server, "/generate", {
            "input_ids": s, "sampling_params": {"temperature": 1.0, "max_new_tokens": 0,
                                                "skip_special_tokens": False},
            "return_logprob": True, "logprob_start_len": 0, "model": model}), SEQS))
        completions = list(pool.map(lambda s: post(server, "/v1/completions", {
            "model": model, "prompt": s, "max_tokens": 0, "echo": True, "logprobs": 1}), SEQS))
        vllm = list(pool.map(lambda s: post(server, "/v1/completions", {
            "model": model, "prompt": s, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}), SEQS))
        per_model = list(pool.map(lambda s: post(server, f"/models/{model}/generate", {
            "input_ids": s, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0}), SEQS))
    for seq, a, b, c, d in zip(SEQS, sglang, completions, vllm, per_model):
        want = native_logprobs(server, model, seq)
        assert a.status_code == b.status_code == c.status_code == d.status_code == 200, (a.text, b.text, c.text)
        entries = a.json()["meta_info"]["input_token_logprobs"]
        assert entries[0] == [None, seq[0], None] and [e[1] for e in entries] == seq
        assert [e[0] for e in entries[1:]] == pytest.approx(want, abs=1e-5)  # as slime reads them
        assert [e[0] for e in d.json()["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(want, abs=1e-5)
        choice = b.json()["choices"][0]
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
        assert b.json()["usage"] == {"prompt_tokens": len(seq), "completion_tokens": 0, "total_tokens": len(seq)}
        plp = c.json()["choices"][0]["prompt_logprobs"]  # vLLM's shape, as verl's teacher reads it
        assert plp[0] is None and len(plp) == len(seq)
        assert [plp[i][str(seq[i])]["logprob"] for i in range(1, len(seq))] == pytest.approx(want, abs=1e-5)
        assert all(len(plp[i]) >= 2 and plp[i][str(seq[i])]["rank"] >= 1 for i in range(1, len(seq)))


def test_generated_tokens_logprobs_are_the_native_apis_of_the_whole_sequence(server):
    r = post(server, "/generate", {"input_ids": SEQS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                                             "ignore_eos": True},
                                   "return_logprob": True, "model": "qwen2"})
    assert r.status_code == 200, r.text
    out = r.json()
    ids = out["output_ids"]
    assert len(ids) == 6 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert out["meta_info"]["input_token_logprobs"] == []  # logprob_start_len -1: the generated tokens' only
    got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in out["meta_info"]["output_token_logprobs"]] == ids
    assert got == pytest.approx(native_logprobs(server, "qwen2", SEQS[0] + ids)[-6:], abs=1e-5)


# -- generation: transformers' own answer -----------------------------------------------------------

@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_greedy_chat_is_transformers_generate_on_the_chat_templates_tokens(server, model):
    from transformers import AutoTokenizer

    path = server.dirs[model]
    tok = AutoTokenizer.from_pretrained(path)
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]]
    client = openai_client(server)
    for messages in conversations:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                           extra_body={"return_token_ids": True})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        want = reference_generate(path, ids, 12)
        got = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
        assert got == (ids, want)
        text = tok.decode(want[:-1] if want[-1] == EOS else want, skip_special_tokens=True)
        assert r.choices[0].message.content == text
        assert r.choices[0].finish_reason == ("stop" if want[-1] == EOS else "length")
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)


def test_seeded_sampling_is_reproducible_whatever_it_is_batched_with(server):
    body = {"model": "llama", "prompt": "The quick brown", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9,
            "top_k": 40, "seed": 1234, "ignore_eos": True, "return_token_ids": True}
    alone = post(server, "/v1/completions", body).json()["choices"][0]["token_ids"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(post, server, "/v1/completions", {**body, "seed": s}) for s in (1, 2, 3)]
        again = pool.submit(post, server, "/v1/completions", body)
        twice = pool.submit(post, server, "/v1/completions", {**body, "n": 2})
        got = again.result().json()["choices"][0]["token_ids"]
        pair = [c["token_ids"] for c in twice.result().json()["choices"]]
        seqs = [f.result().json()["choices"][0]["token_ids"] for f in others]
    assert got == alone and pair[0] == alone and pair[1] != alone
    assert len({tuple(s) for s in seqs + [alone]}) > 1  # the seed matters


def test_generation_stops_at_stop_strings_stop_ids_and_max_tokens(server):
    base = {"model": "llama", "prompt": "Reinforcement", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    free = post(server, "/v1/completions", base).json()["choices"][0]
    ids = free["token_ids"]
    assert free["finish_reason"] == "length" and len(ids) == 12
    stop_id = post(server, "/v1/completions", {**base, "stop_token_ids": [ids[4]]}).json()["choices"][0]
    assert stop_id["token_ids"] == ids[:ids.index(ids[4]) + 1] and stop_id["finish_reason"] == "stop"
    text = free["text"]
    needle = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].isprintable()
                  and "\ufffd" not in text[i:i + 2])
    cut = post(server, "/v1/completions", {**base, "stop": [needle]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == needle
    assert cut["text"] == text[:text.find(needle)] and needle not in cut["text"]
    r = post(server, "/generate", {"text": "Reinforcement", "model": "llama",
                                   "sampling_params": {"temperature": 0, "max_new_tokens": 12, "stop": needle,
                                                       "ignore_eos": True}}).json()
    assert r["text"] == cut["text"] and r["meta_info"]["finish_reason"] == {"type": "stop", "matched": needle}


# -- the openai SDK, unchanged ------------------------------------------------------------------------

def test_the_openai_sdk_lists_completes_chats_and_streams(server):
    import openai

    client = openai_client(server)
    assert {m.id for m in client.models.list()} >= {"llama", "qwen2", "rm"}
    assert client.models.retrieve("qwen2").id == "qwen2"
    c = client.completions.create(model="qwen2", prompt=["Hello", "The quick"], max_tokens=4, n=2, temperature=0.7,
                                  seed=3, logprobs=2)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3] and c.usage.completion_tokens <= 16
    assert all(len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs) for ch in c.choices)
    echo = client.completions.create(model="qwen2", prompt="Paris is the capital", max_tokens=0, echo=True, logprobs=1)
    assert echo.choices[0].text == "Paris is the capital" and echo.choices[0].logprobs.token_logprobs[0] is None
    chat = client.chat.completions.create(model="qwen2", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          logprobs=True, top_logprobs=3, stop=["\n\n"])
    assert chat.choices[0].message.role == "assistant"
    assert all(len(t.top_logprobs) == 3 for t in chat.choices[0].logprobs.content)
    stream = client.chat.completions.create(model="qwen2", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            stream=True, stream_options={"include_usage": True}, temperature=0)
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    plain = client.chat.completions.create(model="qwen2", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           temperature=0)
    assert text == plain.choices[0].message.content and chunks[-1].usage.completion_tokens == 5
    per_model = openai_client(server, base="/models/llama/v1")
    assert [m.id for m in per_model.models.list()] == ["llama"]
    assert per_model.completions.create(model="ignored", prompt="x", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.AuthenticationError):
        openai_client(server, key="wrong-key-0123456789").models.list()


def sse_chunks(r: httpx.Response) -> list:
    """The JSON events of a server-sent-events answer, checked to end with ``[DONE]``."""
    import json

    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_a_streamed_request_gets_each_token_between_two_steps_of_the_decode_loop(dirs):
    """Streaming is the decode loop's own: the k-th token is handed on after the k-th forward
    pass and before the next, with its log-probability and the text it settles; pickled (a model
    on another node), the request is the plain one."""
    import pickle

    from transformers import AutoModelForCausalLM

    from arl_tangram.managers.models import decode as dec
    from arl_tangram.managers.models.generation import Generate, Sampling
    from arl_tangram.server.modelapi.streams import Streamed

    path = dirs["qwen2"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    codec = dec.Codec(path, "qwen2")
    forwards: list[int] = []
    model.register_forward_hook(lambda *a: forwards.append(1))
    events: list[tuple] = []

    def on_token(token, text, logprob, top, pieces):
        events.append((len(forwards), token, text, logprob, top, pieces))

    ask = Generate(text="Reinforcement learning", output_logprobs=True, top_logprobs=2, pieces=True,
                   sampling=Sampling(max_new_tokens=10, temperature=0, ignore_eos=True))
    other = Generate(ids=[5, 17, 3], sampling=Sampling(max_new_tokens=3, temperature=0))
    got, plain = dec.generate(model, codec, dec.eos_ids(path, model, codec), [Streamed(ask, on_token), other])
    assert [e[0] for e in events] == list(range(1, 11)) and len(forwards) == 10  # prefill, then 9 steps
    assert [e[1] for e in events] == got.output_ids and [e[3] for e in events] == got.output_logprobs
    assert [e[4] for e in events] == got.output_top and all(e[1] in e[5] for e in events)
    said = "".join(e[2] for e in events)
    assert said and got.text.startswith(said) and plain.error is None
    assert type(pickle.loads(pickle.dumps(Streamed(ask, on_token)))) is Generate
    assert pickle.loads(pickle.dumps(Streamed(ask, on_token))) == ask


def test_a_stream_read_is_woken_by_a_token_from_the_decode_loops_thread_and_ends_with_the_answers():
    import asyncio

    from arl_tangram.server.modelapi.common import ApiError
    from arl_tangram.server.modelapi.streams import Stream, Waker

    async def main() -> None:
        waker = Waker(asyncio.get_running_loop())
        s = Stream(waker, "m")
        first, second = s.sink(0), s.sink(1)
        assert (await s.read(0, 0.01))["events"] == []  # none yet: the wait ran out
        threading.Timer(0.05, lambda: (first(7, "a", -0.5, None, None), second(8, "", -1.0, None, None))).start()
        t = time.monotonic()
        got = await s.read(0, 60)
        assert time.monotonic() - t < 30 and not got["done"]  # woken by the token, not by the wait's end
        while len(got["events"]) < 2:
            got = {**got, "events": got["events"] + (await s.read(len(got["events"]), 60))["events"]}
        assert got["events"] == [(0, 7, "a", -0.5, None, None), (1, 8, "", -1.0, None, None)]
        s.finish(["answer"])
        assert await s.read(2, 60) == {"events": [], "done": True, "model": "m", "answers": ["answer"]}
        failed = Stream(waker, "m")
        failed.finish(error=ApiError(400, "prompt: too long", param="prompt"))
        with pytest.raises(ApiError):
            await failed.read(0, 60)

    asyncio.run(main())


def test_streams_send_a_chunk_per_token_that_add_up_to_the_whole_answer(server):
    base = {"model": "llama", "prompt": "Reinforcement", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = post(server, "/v1/completions", {**base, "logprobs": 1}).json()["choices"][0]
    chunks = sse_chunks(post(server, "/v1/completions", {**base, "logprobs": 1, "stream": True,
                                                         "stream_options": {"include_usage": True}}))
    tokens = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert len(tokens) == 12  # one chunk per token
    assert [t["logprobs"]["tokens"][0] for t in tokens] == whole["logprobs"]["tokens"]
    assert [t["logprobs"]["text_offset"][0] for t in tokens] == whole["logprobs"]["text_offset"]
    assert [t["logprobs"]["token_logprobs"][0] for t in tokens] == pytest.approx(whole["logprobs"]["token_logprobs"])
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 12
    # a stop string: no chunk sends what the answer cuts
    text = whole["text"]
    needle = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].isprintable()
                  and "\ufffd" not in text[i:i + 2])
    cut = post(server, "/v1/completions", {**base, "stop": [needle]}).json()["choices"][0]
    chunks = sse_chunks(post(server, "/v1/completions", {**base, "stop": [needle], "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut["text"] and cut["finish_reason"] == "stop"
    # chat, n samples: every choice's tokens, log-probabilities and text
    chat = {"model": "qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0.8,
            "seed": 5, "n": 2, "logprobs": True, "ignore_eos": True}
    want = post(server, "/v1/chat/completions", chat).json()["choices"]
    chunks = sse_chunks(post(server, "/v1/chat/completions", {**chat, "stream": True}))
    for i, w in enumerate(want):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""} and mine[-1]["finish_reason"] == "length"
        entries = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        assert [e["token"] for e in entries] == [e["token"] for e in w["logprobs"]["content"]]
        assert [e["logprob"] for e in entries] == pytest.approx([e["logprob"] for e in w["logprobs"]["content"]])
        assert "".join(c["delta"].get("content", "") for c in mine) == w["message"]["content"]
    # an input the model refuses (past its context once templated) is the 400, not a stream
    r = post(server, "/v1/chat/completions", {"model": "llama", "stream": True, "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "word " * 200}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# -- plain HTTP exactly as the frameworks send it --------------------------------------------------

def test_slimes_teacher_and_remote_reward_model_bodies(server):
    tokens = SEQS[2]
    r = post(server, "/models/qwen2/generate", {  # slime's on-policy distillation teacher request
        "input_ids": tokens,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True, "logprob_start_len": 0})
    assert r.status_code == 200, r.text
    teacher = [item[0] for item in r.json()["meta_info"]["input_token_logprobs"][1:]]
    assert teacher == pytest.approx(native_logprobs(server, "qwen2", tokens), abs=1e-5)
    r = post(server, "/slime/rm", {"prompt": "What is 2+2?", "response": " 4", "label": "4"})
    assert r.status_code == 200 and isinstance(r.json(), float), r.text
    score = post(server, "/v1/models/rm/score", {"tokens": _tokens(server, "rm", "What is 2+2? 4")}).json()["value"]
    assert r.json() == pytest.approx(score, abs=1e-5)


def test_verls_reward_model_and_judge_bodies(server):
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    r = post(server, "/classify", {"model": server.dirs["rm"], "input": text, "use_activation": False})
    assert r.status_code == 200, r.text
    rm_score = r.json()["data"][-1]["probs"][-1]  # as verl reads it
    assert rm_score == pytest.approx(post(server, "/v1/models/rm/score",
                                          {"tokens": _tokens(server, "rm", text)}).json()["value"], abs=1e-5)
    old = post(server, "/classify", {"model": server.dirs["rm"], "input": text, "activation": False})
    assert old.json()["data"][-1]["probs"][-1] == pytest.approx(rm_score, abs=1e-6)
    activated = post(server, "/classify", {"model": "rm", "input": text}).json()["data"][0]["probs"][0]
    assert activated == pytest.approx(1 / (1 + 2.718281828459045 ** -rm_score), abs=1e-5)
    r = post(server, "/v1/embeddings", {"model": server.dirs["rm"], "input": text})
    assert r.json()["data"][-1]["embedding"][-1] == pytest.approx(rm_score, abs=1e-5)
    pooled = post(server, "/pooling", {"model": "rm", "input": [text, "hi"]}).json()
    assert pooled["data"][0]["data"] == pytest.approx([rm_score], abs=1e-5) and len(pooled["data"]) == 2
    r = post(server, "/v1/chat/completions", {"model": "llama", "messages": [  # a generative judge
        {"role": "user", "content": "Is 2+2=4 correct? Answer yes or no."}]}
        | {"max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text
    seq = SEQS[0]  # the teacher: token ids, vLLM's prompt_logprobs, one token
    r = post(server, "/v1/completions", {"model": server.dirs["llama"], "prompt": seq, "max_tokens": 1,
                                         "prompt_logprobs": 0, "temperature": 0})
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert [plp[i][str(seq[i])]["logprob"] for i in range(1, len(seq))] == pytest.approx(
        native_logprobs(server, "llama", seq), abs=1e-5)


def test_openrlhfs_remote_reward_model_body(server):
    queries = ["What is 2+2? 4", "What is 2+2? 5", "Name a colour. Blue"]
    r = post(server, "/openrlhf/reward", {"query": queries, "prompts": ["What is 2+2?", "What is 2+2?",
                                                                          "Name a colour."],
                                          "labels": ["4", "4", "any"]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"rewards", "scores", "extra_logs"} and len(out["rewards"]) == 3
    for q, v in zip(queries, out["rewards"]):
        assert v == pytest.approx(post(server, "/v1/models/rm/score", {"tokens": _tokens(server, "rm", q)}).json()[
            "value"], abs=1e-5)


def _tokens(server, model: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.dirs[model])(text)["input_ids"]


# -- quotas ------------------------------------------------------------------------------------------

def test_quotas_answer_429_with_retry_after_in_each_protocols_shape_and_count_in_metrics(server):
    import openai

    client = openai_client(server, key=LIMITED)
    for _ in range(3):  # 3 requests a minute for job "limited", per model
        client.completions.create(model="llama", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="llama", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "rate_limit_exceeded" and e.value.body["type"] == "requests"
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
    short = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    r = post(server, "/generate", {**short, "model": "llama"}, key=LIMITED)
    assert r.status_code == 429 and r.json() == {"error": {"message": r.json()["error"]["message"]}}
    assert int(r.headers["retry-after"]) >= 1
    assert post(server, "/generate", {**short, "model": "llama"}).status_code == 200  # another job
    assert post(server, "/generate", {**short, "model": "qwen2"}, key=LIMITED).status_code == 200
    # 5 tokens a minute on the reward model: the first request takes the window past it
    assert post(server, "/classify", {"model": "rm", "input": [1, 2, 3, 4, 5, 6]}, key=LIMITED).status_code == 200
    r = post(server, "/classify", {"model": "rm", "input": [1, 2]}, key=LIMITED)
    assert r.status_code == 429 and r.json()["error"]["code"] == 429 and "tokens" in r.json()["error"]["message"]
    assert 1 <= int(r.headers["retry-after"]) <= 60
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'tangram_model_api_throttled_total{job="limited",limit="requests",model="llama"} 2.0' in text
    assert 'tangram_model_api_throttled_total{job="limited",limit="tokens",model="rm"} 1.0' in text
    assert 'tangram_model_api_tokens_total{job="limited",kind="prompt",model="rm"} 6.0' in text


# -- bad input: a 4xx in the protocol's shape, the rest of the batch answered ------------------------

def test_bad_input_is_a_4xx_in_each_protocols_shape_and_the_batch_goes_on(server):
    long = "word " * 200  # past the 128 positions once tokenized: found where the batch runs
    good = {"model": "llama", "prompt": SEQS[0], "max_tokens": 0, "echo": True, "logprobs": 0}
    cases = [
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "openai"),
        ("/v1/completions", {"model": "llama", "prompt": [1, 320]}, 400, "openai"),
        ("/v1/completions", {"model": "llama", "prompt": long, "max_tokens": 4}, 400, "openai"),
        ("/v1/completions", {"model": "llama", "prompt": "x", "max_tokens": -1}, 400, "openai"),
        ("/v1/completions", {"model": "llama", "prompt": [1, 2], "max_tokens": 500}, 400, "openai"),
        ("/v1/completions", {"model": "rm", "prompt": "x"}, 400, "openai"),
        ("/v1/completions", {"model": "bare", "prompt": "text without a tokenizer"}, 400, "openai"),
        ("/v1/chat/completions", {"model": "llama", "messages": "hi"}, 400, "openai"),
        ("/v1/chat/completions", {"model": "llama", "messages": [{"content": "no role"}]}, 400, "openai"),
        ("/v1/chat/completions", {"model": "llama", "messages": [{"role": "robot", "content": "x"}]}, 400, "openai"),
        ("/v1/chat/completions", {"model": "llama", "messages": [{"role": "user", "content": long}]}, 400, "openai"),
        ("/v1/chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "x"}],
                                  "max_tokens": -5}, 400, "openai"),
        ("/v1/chat/completions", {"model": "llama", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         400, "openai"),
        ("/v1/completions", {"model": "llama"}, 400, "openai"),
        ("/generate", {"input_ids": [1, 999], "model": "llama"}, 400, "sglang"),
        ("/generate", {"text": long, "model": "llama"}, 400, "sglang"),
        ("/generate", {"input_ids": [1], "model": "llama", "sampling_params": {"max_new_tokens": -1}}, 400, "sglang"),
        ("/generate", {"input_ids": [1], "model": "nope"}, 404, "sglang"),
        ("/generate", {"input_ids": [1], "model": "llama", "sampling_params": {"bogus": 1}}, 400, "sglang"),
        ("/models/nope/generate", {"input_ids": [1]}, 404, "sglang"),
        ("/generate", {"model": "llama"}, 400, "sglang"),
        ("/classify", {"model": "rm", "input": [1, 999]}, 400, "vllm"),
        ("/classify", {"model": "llama", "input": "x"}, 400, "vllm"),
        ("/classify", {"model": "nope", "input": "x"}, 404, "vllm"),
        ("/classify", {"model": "rm", "input": long}, 400, "vllm"),
        ("/v1/embeddings", {"model": "rm", "input": []}, 400, "vllm"),
        ("/openrlhf/reward", {"query": "not a list"}, 400, "vllm"),
        ("/slime/rm", {"prompt": "x"}, 400, "vllm"),
    ]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:  # the bad beside good requests, in their batches
        goods = [pool.submit(post, server, "/v1/completions", good) for _ in range(4)]
        bads = [pool.submit(post, server, path, body) for path, body, _, _ in cases]
        want = native_logprobs(server, "llama", SEQS[0])
        for f in goods:
            r = f.result()
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
        for (path, body, status, shape), f in zip(cases, bads):
            r = f.result()
            assert r.status_code == status, (path, body, r.status_code, r.text)
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["message"]
            if shape == "openai":
                assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            elif shape == "sglang":
                assert set(err) == {"message"}
            else:
                assert err["code"] == status
    assert httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10,
                      headers={"Authorization": f"Bearer {FREE}"}).json()["error"]["message"] == "body: not valid JSON"
    r = httpx.get(server.url + "/v1/completions", headers={"Authorization": f"Bearer {FREE}"})
    assert r.status_code == 405 and "error" in r.json()


def test_a_tokens_text_is_decoded_once_and_is_the_tokenizers_every_time(dirs):
    from arl_tangram.managers.models.decode import Codec

    codec = Codec(dirs["qwen2"], "qwen2")
    backend = codec.tokenizer.backend_tokenizer
    want = {t: backend.decode([t], skip_special_tokens=False) for t in (0, 3, 5, 17, 88)}
    assert codec.pieces({5, 17, 3}) == {t: want[t] for t in (3, 5, 17)}
    assert codec.pieces({0, 3, 88}) == {t: want[t] for t in (0, 3, 88)}  # known and new together
    assert Codec(dirs["bare"], "bare").pieces({7}) == {7: "token_id:7"}


def test_the_protocols_table_finds_its_routes_by_path_and_leaves_every_other_to_the_apps_routes():
    """One entry first in the app's table: a protocol route found by its path (a model's URL and a
    trailing name included), another method a partial match (a later full match still wins, else
    the 405), any other path no match at all."""
    from starlette.routing import Match, Route

    from arl_tangram.server.app import create_app
    from arl_tangram.server.modelapi.table import Table

    async def one(request):  # pragma: no cover - never called
        raise AssertionError

    table = Table()
    for path, methods in (("/generate", ["POST"]), ("/models/{model}/generate", ["POST"]), ("/v1/models", ["GET"]),
                          ("/v1/models/{name:path}", ["GET"]), ("/models/{model}/v1/models/{name:path}", ["GET"])):
        table.add_route(path, one, methods)

    def match(path, method="POST", **scope):
        return table.matches({"type": "http", "path": path, "method": method, "path_params": {}, **scope})

    assert match("/generate")[0] == Match.FULL and match("/generate")[1]["path_params"] == {}
    assert match("/models/lm/generate")[1]["path_params"] == {"model": "lm"}
    assert match("/v1/models/org/name", "GET")[1]["path_params"] == {"name": "org/name"}
    assert match("/models/lm/v1/models/x", "HEAD")[0] == Match.FULL  # a GET route answers HEAD, as Starlette's
    assert match("/models/lm/v1/models/x", "HEAD")[1]["path_params"] == {"model": "lm", "name": "x"}
    assert match("/v1/models/lm/logprobs")[0] == Match.PARTIAL  # the native route after it matches fully
    assert match("/api/generate", root_path="/api")[0] == Match.FULL
    for path in ("/generatex", "/models//generate", "/models/lm", "/models/lm/nope", "/sandboxes", "/"):
        assert match(path)[0] == Match.NONE, path
    assert table.matches({"type": "websocket", "path": "/generate"})[0] == Match.NONE
    with pytest.raises(ValueError):
        table.add_route("/generate", one, ["POST"])
    with pytest.raises(ValueError):
        table.add_route("/a/{b}/c", one, ["POST"])
    app = create_app(object())
    first = next(i for i, r in enumerate(app.routes) if isinstance(r, Table))
    assert not any(isinstance(r, Route) for r in app.routes[:first])  # before every route of a path (as its own)
    assert not any(getattr(r, "path", "") in ("/generate", "/v1/completions") for r in app.routes)


# -- tangram serve, with HTTP front processes ----------------------------------------------------------

@pytest.mark.slow
def test_tangram_serve_with_fronts_answers_the_protocols_across_the_link(tmp_path, dirs):
    """The default dialect in ``tangram serve`` (over the sandbox double) with a front process: the
    requests cross the link as plain data, the protocols' errors as themselves."""
    import openai

    from servers import Server

    config = {"models": [{"name": "llama", "hf": dirs["llama"], "task": "logprobs", "max_wait_ms": 20},
                         {"name": "rm", "hf": dirs["rm"], "task": "score"}],
              "model_api": {"reward_routes": [{"path": "/openrlhf/reward", "model": "rm", "shape": "openrlhf"}]}}
    server = Server(tmp_path, config, double=True, args=("--fronts", "1"), start_timeout_s=180)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        c = client.completions.create(model="llama", prompt=SEQS[0], max_tokens=0, echo=True, logprobs=0)
        want = httpx.post(server.url + "/v1/models/llama/logprobs", json={"tokens": SEQS[0]}).json()["value"]
        assert c.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
        chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, temperature=0)
        assert chat.usage.completion_tokens <= 3
        streamed = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3, temperature=0, stream=True)  # read across the link
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == chat.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="llama", prompt=[1, 99999])
        assert e.value.body["param"] == "prompt"
        r = httpx.post(server.url + "/generate", json={"input_ids": SEQS[1], "return_logprob": True,
                                                       "logprob_start_len": 0,
                                                       "sampling_params": {"max_new_tokens": 0}})
        assert r.status_code == 200 and len(r.json()["meta_info"]["input_token_logprobs"]) == len(SEQS[1])
        r = httpx.post(server.url + "/classify", json={"model": "rm", "input": "hello"})
        assert r.status_code == 200 and r.json()["data"][0]["num_classes"] == 1
        # the config's [model_api] reached the front's routes and the engine process's calls
        r = httpx.post(server.url + "/openrlhf/reward", json={"query": ["a b", "c"], "prompts": ["a", "c"],
                                                              "labels": ["", ""]})
        assert r.status_code == 200 and len(r.json()["rewards"]) == 2, r.text
    finally:
        server.stop()


# -- the bench -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_bench_measures_each_protocols_overhead_and_decode_against_transformers():
    from typer.testing import CliRunner

    from arl_tangram.bench.modelapi import run
    from arl_tangram.cli import app

    out = run("cpu", ("overhead", "decode"), requests=10, batches=(1, 3), new_tokens=4, prompt_len=5, runs=1,
              log=lambda m: None)
    added = out["overhead"]["added_over_native"]
    assert {"sglang /generate", "openai /v1/completions echo", "vllm /classify", "sglang /v1/embeddings",
            "openrlhf reward", "slime reward"} <= set(added)
    assert all(isinstance(v["added_ms"], float) for v in added.values())
    assert "added_cpu_ms_less_tokenizing" in added["openrlhf reward"] and out["overhead"]["tokenize_cpu_ms"] > 0
    assert out["overhead"]["stream_added"]["tokens"] == 16 and "openai chat streamed" not in added
    for b in ("1", "3"):
        row = out["decode"]["batches"][b]
        assert row["tangram"]["tokens_per_s"] > 0 and row["transformers"]["tokens_per_s"] > 0
        assert row["rows_identical_to_transformers"] == f"{b}/{b}" and row["bound_tokens_per_s"] > 0
    r = CliRunner().invoke(app, ["bench", "modelapi", "--sections", "nope"])
    assert r.exit_code != 0 and "--sections" in r.output
