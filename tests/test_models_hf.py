"""Model services from local Hugging Face directories: tiny Llama and Qwen2 models with random
weights, saved with ``save_pretrained`` and served from the directory (CPU devices)."""

import asyncio
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from arl_tangram.core import Outcome  # noqa: E402
from arl_tangram.managers.models.spec import ModelDirError  # noqa: E402
from arl_tangram.managers.models.spec import ModelServiceConfig as M  # noqa: E402
from arl_tangram.runtime import Tangram  # noqa: E402

from model_fixtures import hf_reference, save_hf  # noqa: E402

# mixed lengths, no token 0 (the reward model's pad id: transformers' own pooling skips it)
SEQS = [[5, 17, 3, 88, 41], [9, 2], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7], [33, 34, 35]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"llama": save_hf(root / "llama", "llama", tied=True, seed=1),
            "qwen2": save_hf(root / "qwen2", "qwen2", seed=2),
            "rm": save_hf(root / "rm", "qwen2-rm", seed=3),
            "rm3": save_hf(root / "rm3", "qwen2-rm", seed=4, labels=3)}


def run(body, **kw):
    async def main():
        async with Tangram.local(sandboxes=False, **kw) as tg:
            return await body(tg)
    return asyncio.run(main())


def batched(op, name, seqs):
    async def body(tg):
        return await asyncio.gather(*(getattr(tg, op)(name, s) for s in seqs))
    return body


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logprobs_match_transformers_float32_in_batches_of_mixed_lengths(dirs, arch):
    rs = run(batched("logprobs", "t", SEQS), models=[M("t", hf=dirs[arch], task="logprobs", max_wait_ms=50)])
    assert all(r.outcome is Outcome.OK for r in rs), [r.message for r in rs]
    for seq, r in zip(SEQS, rs):
        want = hf_reference(dirs[arch], "logprobs", seq)
        assert len(r.result) == len(seq) - 1
        assert r.result == pytest.approx(want, abs=1e-4)
    assert len({tuple(r.result) for r in rs}) == len(SEQS)  # not all the same answer


def test_scores_match_transformers_float32_and_batching_changes_nothing(dirs):
    rm = [M("rm", hf=dirs["rm"], task="score", max_wait_ms=50), M("rm3", hf=dirs["rm3"], task="score", max_batch=1)]
    rs = run(batched("score", "rm", SEQS), models=rm)
    alone = run(lambda tg: tg.score("rm", SEQS[2]), models=rm)
    three = run(lambda tg: tg.score("rm3", SEQS[0]), models=rm)
    assert all(r.ok for r in rs) and alone.ok and three.ok
    assert [r.result for r in rs] == pytest.approx([hf_reference(dirs["rm"], "score", s) for s in SEQS], abs=1e-4)
    assert rs[2].result == pytest.approx(alone.result, abs=1e-5)
    assert three.result == pytest.approx(hf_reference(dirs["rm3"], "score", SEQS[0]), abs=1e-4)


def test_weights_lie_in_one_host_buffer_and_every_buffer_is_carried(dirs):
    """No second host copy: every checkpoint tensor is a view of one buffer. The rotary
    ``inv_freq`` (a non-persistent buffer, in no state_dict) is carried with the weights; the
    tied output embedding is the input embedding's tensor, not a copy."""
    from arl_tangram.managers.models.manager import ModelManager

    mm = ModelManager([M("t", hf=dirs["llama"], task="logprobs")], lambda r: None, device="cpu")
    mm.load_all()
    ld = mm.loaded["t"]
    weights = [v for k, v in ld.host_state.items() if "rotary" not in k]
    assert len({v.untyped_storage().data_ptr() for v in weights}) == 1
    assert ld.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "model.rotary_emb.inv_freq" in ld.host_state and "model.rotary_emb.inv_freq" not in ld.persistent
    # read straight into the packed layout (``packing``), the constructor's buffers too
    assert {v.untyped_storage().data_ptr() for v in ld.host_state.values()} == {ld.packed.data_ptr()}
    assert all(v.data_ptr() == ld.packed.data_ptr() + ld.layout.at(k) for k, v in ld.host_state.items())
    assert all(p.device.type == "meta" for p in ld.skeleton.parameters())
    assert ld.vocab == 96 and ld.max_len == 64
    from arl_tangram.managers.models.manager import logits_gb
    # 16 rows of 64 tokens of 96 float32 logits, and one row twice in float32
    assert logits_gb(ld) == pytest.approx((16 * 64 * 96 * 4 + 2 * 64 * 96 * 4) / 1e9)
    asyncio.run(mm.shut_down())
    assert mm.loaded == {}  # host memory let go at shut-down, whoever holds the manager


def test_a_custom_loader_returning_a_transformers_llama_works(dirs):
    """The failure of issue 23: a Llama from a custom loader failed its first call on the meta
    ``inv_freq``."""
    rs = run(batched("logprobs", "t", SEQS[:2]),
             models=[M("t", "model_fixtures:llama_loader", {"path": dirs["llama"]}, max_wait_ms=50)])
    assert all(r.ok for r in rs), rs[0].message
    assert rs[0].result == pytest.approx(hf_reference(dirs["llama"], "logprobs", SEQS[0]), abs=1e-4)


def test_bad_input_is_a_rejection_naming_it_and_fails_no_other_caller(dirs):
    async def body(tg):
        return await asyncio.gather(tg.logprobs("t", [1, 96]), tg.logprobs("t", []), tg.logprobs("t", [1] * 65),
                                    tg.logprobs("t", [3, -1]), tg.logprobs("t", [1, 2, 3]), tg.logprobs("t", [4]),
                                    tg.logprobs("t", [1] * 64))

    oob, empty, long, neg, fine, short, longest = run(body, models=[M("t", hf=dirs["llama"], task="logprobs",
                                                                      max_wait_ms=50)])
    assert oob.outcome is Outcome.REJECTED and "id 96 out of range [0, 96)" in oob.message
    assert empty.outcome is Outcome.REJECTED and "tokens: empty" in empty.message
    assert long.outcome is Outcome.REJECTED and "65 tokens, longer than model 't''s 64 positions" in long.message
    assert neg.outcome is Outcome.REJECTED and "id -1" in neg.message
    assert short.outcome is Outcome.REJECTED and "at least 2" in short.message
    assert fine.ok and len(fine.result) == 2 and longest.ok and len(longest.result) == 63


def test_dtype_casts_the_weights_as_they_are_read(dirs):
    from arl_tangram.managers.models.manager import ModelManager

    mm = ModelManager([M("t", hf=dirs["qwen2"], task="logprobs", dtype="bfloat16")], lambda r: None, device="cpu")
    mm.load_all()
    dtypes = {v.dtype for k, v in mm.loaded["t"].host_state.items() if "rotary" not in k}
    asyncio.run(mm.shut_down())
    assert dtypes == {torch.bfloat16}
    r = run(lambda tg: tg.logprobs("t", SEQS[0]), models=[M("t", hf=dirs["qwen2"], task="logprobs", dtype="bfloat16")])
    assert r.ok and r.result == pytest.approx(hf_reference(dirs["qwen2"], "logprobs", SEQS[0]), abs=0.3)


def test_a_model_split_over_two_devices_answers_as_on_one(dirs):
    one = run(batched("logprobs", "t", SEQS), models=[M("t", hf=dirs["llama"], task="logprobs", max_wait_ms=50)])
    two = run(batched("logprobs", "t", SEQS), models=[M("t", hf=dirs["llama"], task="logprobs", gpus=2,
                                                        max_wait_ms=50)], gpus=2)
    assert all(r.ok for r in one + two)
    assert sum((r.result for r in two), []) == pytest.approx(sum((r.result for r in one), []), abs=1e-6)
    from arl_tangram.managers.models.manager import ModelManager
    from arl_tangram.managers.models.placement import place, stages

    mm = ModelManager([M("t", hf=dirs["llama"], task="logprobs")], lambda r: None, device="cpu")
    mm.load_all()
    skeleton = mm.loaded["t"].skeleton
    assert {p: s for p, _, s in stages(skeleton, 2)} == {"model.embed_tokens": 0, "model.layers.0": 0,
                                                         "model.layers.1": 1, "model.norm": 1, "model.rotary_emb": 1,
                                                         "lm_head": 1}
    where = place(skeleton, [torch.device("meta", 0), torch.device("meta", 1)])
    # the tied output embedding is used on the second device: it gets a copy there
    assert where["lm_head.weight"].index == 1 and where["model.embed_tokens.weight"].index == 0
    asyncio.run(mm.shut_down())


def test_a_directory_that_cannot_be_served_stops_the_start_naming_the_path(dirs, tmp_path):
    from arl_tangram.server.config import ConfigError, load

    with pytest.raises(ValueError, match="give exactly one of loader"):
        M("t")
    with pytest.raises(ValueError, match="task"):
        M("t", hf=dirs["llama"])
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelDirError, match=f"{missing} does not exist"):
        run(lambda tg: None, models=[M("t", hf=str(missing), task="logprobs")])
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"models": [{"name": "t", "hf": str(missing), "task": "logprobs"}]}))
    with pytest.raises(ConfigError, match=f"models.0: .*{missing} does not exist"):
        load(cfg)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(open(f"{dirs['llama']}/config.json").read())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelDirError, match=f"cannot read {broken}/model.safetensors"):
        run(lambda tg: None, models=[M("t", hf=str(broken), task="logprobs")])
    with pytest.raises(ModelDirError, match=f"{dirs['llama']} has no weights for score.weight"):
        run(lambda tg: None, models=[M("t", hf=dirs["llama"], task="score")])


@pytest.mark.slow  # ~20 s: the server process imports transformers (~8 s here) before it listens
def test_a_server_config_with_hf_serves_over_http(dirs, tmp_path):
    import httpx

    from arl_tangram.client import TangramClient, TangramError
    from servers import Server

    s = Server(tmp_path, config={"models": [{"name": "teacher", "hf": dirs["qwen2"], "task": "logprobs"},
                                            {"name": "rm", "hf": dirs["rm"], "task": "score", "max_batch": 4}]},
               start_timeout_s=60)
    try:
        with TangramClient(s.url) as c:
            lp = c.logprobs("teacher", SEQS[0])
            assert lp.outcome == "ok" and lp.value == pytest.approx(hf_reference(dirs["qwen2"], "logprobs", SEQS[0]),
                                                                    abs=1e-4)
            r = c.score("rm", SEQS[1])
            assert r.outcome == "ok" and r.value == pytest.approx(hf_reference(dirs["rm"], "score", SEQS[1]), abs=1e-4)
            with pytest.raises(TangramError, match="out of range"):  # bad input: a 422 naming it
                c.score("rm", [1, 96])
        empty = httpx.post(f"{s.url}/v1/models/rm/score", json={"tokens": []})
        assert empty.status_code == 422 and empty.json()["message"].startswith("tokens: empty"), empty.text
    finally:
        s.stop()


def test_graph_buckets_pad_batches_without_changing_answers(dirs):
    """A copy with CUDA graphs runs each batch padded to its bucket (rows to a power of two,
    lengths to one from 64); on CPU the same padding runs eagerly: answers must not change."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from arl_tangram.managers.models import graphs, hf, tiny

    seqs = SEQS[:3]
    cases = [(*tiny.teacher_model(), "logprobs"), (*tiny.reward_model(), "score"),
             (AutoModelForCausalLM.from_pretrained(dirs["llama"]).eval(), {"logprobs": hf.logprobs}, "logprobs"),
             (AutoModelForSequenceClassification.from_pretrained(dirs["rm"]).eval(), {"score": hf.score}, "score")]
    for model, ops, op in cases:
        plain = ops[op](model, seqs)
        model.tangram_graphs = graphs.Graphs(capture=False)
        assert graphs.shape_of(model, seqs, getattr(getattr(model, "config", None), "max_position_embeddings", None)) \
            == (4, 64)
        padded = ops[op](model, seqs)
        flat = (lambda xs: sum(xs, [])) if op == "logprobs" else (lambda xs: xs)
        assert len(padded) == len(seqs) and flat(padded) == pytest.approx(flat(plain), abs=1e-5)
        model.tangram_graphs.max_tokens = 64  # over the budget: the batch runs as it is
        assert graphs.shape_of(model, seqs) == (3, 11)


def test_a_model_too_big_for_one_device_is_served_split_over_two():
    """4 GB a device: a copy that needs 6 GB fits no single device and is served over two, with
    the answers of one device."""
    kw = {"layers": 4, "seed": 5}
    seqs = [[3, 1, 4, 1, 5], [9, 2, 6]]
    big = run(batched("score", "rm", seqs), models=[M("rm", "arl_tangram.managers.models.tiny:reward_model", kw,
                                                      gpus=2, memory_gb=6.0, max_wait_ms=50)],
              gpus=2, gpu_memory_gb=4.0)
    alone = run(batched("score", "rm", seqs), models=[M("rm", "arl_tangram.managers.models.tiny:reward_model", kw,
                                                        max_wait_ms=50)])
    too_big = run(lambda tg: tg.score("rm", seqs[0]), models=[M("rm", "arl_tangram.managers.models.tiny:reward_model",
                                                                kw, memory_gb=6.0)], gpus=2, gpu_memory_gb=4.0)
    assert all(r.ok for r in big), big[0].message
    assert [r.result for r in big] == pytest.approx([r.result for r in alone], abs=1e-6)
    assert too_big.outcome is Outcome.REJECTED and "more than any GPU holds" in too_big.message
