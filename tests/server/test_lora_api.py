"""`pagedllm serve --enable-lora`: adapters from --lora-modules (both forms) are models of their own in /v1/models
with the base model as parent, a request names one as its "model" and gets transformers + peft's greedy output,
streamed or not; with --allow-runtime-lora-updating adapters load and unload while requests run, a bad one is a
400 and the others serve on; without it those paths are 404s."""
from __future__ import annotations

import json
import threading
import weakref
from typing import Optional

import httpx
import openai
import pytest
import torch

from tests.e2e.test_lora import ADAPTERS, _random_adapter
from tests.model_fixtures import smollm_reference
from tests.server.conftest import RemoteServer

pytest.importorskip("peft")
PROMPT = "Once upon a time, in a small village,"  # each adapter changes the base model's continuation
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """name -> (its directory, transformers + peft greedy text for PROMPT)."""
    reference = smollm_reference()
    made = {}
    for i, (name, settings) in enumerate(ADAPTERS.items()):
        path = tmp_path_factory.mktemp(name)
        model = _random_adapter(reference, settings, i, path)
        made[name] = (str(path), model)
    return made


_greedy_texts: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def peft_greedy_text(model, tokenizer) -> str:
    """Memoized per model: two tests check the all-r8 adapter's text."""
    if model not in _greedy_texts:
        _greedy_texts[model] = _peft_greedy_text(model, tokenizer)
    return _greedy_texts[model]


def _peft_greedy_text(model, tokenizer) -> str:
    prompt = tokenizer.encode(PROMPT)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, adapters):
    qkv = json.dumps({"name": "qkv-r4", "path": adapters["qkv-r4"][0]})
    srv = RemoteServer(tmp_path_factory.mktemp("lora") / "server.log", extra_args=[
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
        "--lora-modules", f"all-r8={adapters['all-r8'][0]}", qkv])
    yield srv
    srv.stop()


def complete(server: RemoteServer, model: str, stream: bool) -> str:
    client = server.get_client()
    if not stream:
        response = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        return response.choices[0].text
    chunks = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def test_adapters_are_models_whose_output_is_transformers_with_peft(lora_server, adapters, tokenizer):
    cards = {card.id: card for card in lora_server.get_client().models.list().data}
    base = next(name for name, card in cards.items() if getattr(card, "parent", None) is None)
    assert {name: getattr(card, "parent", None) for name, card in cards.items() if name != base} == \
        {"all-r8": base, "qkv-r4": base}
    for name in ("all-r8", "qkv-r4"):
        expected = peft_greedy_text(adapters[name][1], tokenizer)
        assert complete(lora_server, name, stream=False) == expected
        assert complete(lora_server, name, stream=True) == expected
    base_text = complete(lora_server, base, stream=False)
    assert all(complete(lora_server, name, stream=False) != base_text for name in ("all-r8", "qkv-r4"))


def test_load_and_unload_at_run_time_and_a_bad_adapter_is_a_400(lora_server, adapters, tokenizer, tmp_path):
    http = lora_server.http()
    running = []  # a request on another adapter runs while adapters load and fail to
    thread = threading.Thread(target=lambda: running.append(complete(lora_server, "all-r8", stream=True)))
    thread.start()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 64, "lora_alpha": 8}')
    (bad / "adapter_model.safetensors").write_bytes(b"")
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert response.status_code == 400
    assert "rank r=64 exceeds max_lora_rank=16" in response.json()["error"]["message"]
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "rslora-r16",
                                                        "lora_path": adapters["rslora-r16"][0]})
    assert response.status_code == 200, response.text
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "rslora-r16", "lora_path": "/x"}
                     ).status_code == 400  # the name is taken
    thread.join(60)
    assert running == [peft_greedy_text(adapters["all-r8"][1], tokenizer)]

    assert complete(lora_server, "rslora-r16", stream=False) == peft_greedy_text(adapters["rslora-r16"][1],
                                                                                  tokenizer)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "rslora-r16"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(lora_server, "rslora-r16", stream=False)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "rslora-r16"}).status_code == 404
    assert "rslora-r16" not in {card.id for card in lora_server.get_client().models.list().data}


def test_lora_requests_info_names_the_adapters_that_ran(lora_server):
    """vLLM's gauge: one series per (max_lora, waiting, running) seen, its value the time it was last seen."""
    series = [key for key in lora_server.metrics() if key.startswith("pagedllm:lora_requests_info{")]
    assert series and all("max_lora=2" in key for key in series)
    assert any("running_lora_adapters=all-r8" in key for key in series)


def test_without_allow_runtime_lora_updating_the_paths_are_404(server):
    response = httpx.post(server.url_for("v1", "load_lora_adapter"), headers=server.headers,
                          json={"lora_name": "x", "lora_path": "/x"})
    assert response.status_code == 404


def _adapter_dirs(root, *names: str) -> dict[str, str]:
    """name -> a directory holding an adapter_config.json (the serving checks it is there; the fake processor of
    these tests takes any)."""
    for name in names:
        (root / name).mkdir()
        (root / name / "adapter_config.json").write_text("{}")
    return {name: str(root / name) for name in names}


def _engine_client(processor, loaded: Optional[list] = None, removed: Optional[list] = None):
    """An engine client with ``processor``, whose add_lora / remove_lora note the adapter / id in ``loaded`` /
    ``removed``."""
    from types import SimpleNamespace

    loaded, removed = [] if loaded is None else loaded, [] if removed is None else removed

    async def add_lora(lora):
        loaded.append(lora)
        return True

    async def remove_lora(lora_id):
        removed.append(lora_id)
        return True

    return SimpleNamespace(processor=processor, add_lora=add_lora, remove_lora=remove_lora)


def test_a_json_lora_modules_base_model_name_is_its_parent_in_v1_models(tmp_path):
    """--lora-modules' JSON form may name the served model an adapter belongs to (vLLM's base_model_name): /v1/models
    gives it as the adapter's parent; a name not served is ignored, and the parent is the first served name."""
    import argparse
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.api_server import init_app_state
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    paths = _adapter_dirs(tmp_path, "sql", "chat", "plain")
    args = make_arg_parser(argparse.ArgumentParser()).parse_args([
        "--enable-lora", "--served-model-name", "base", "alias", "--lora-modules",
        json.dumps({"name": "sql", "path": paths["sql"], "base_model_name": "alias"}),
        json.dumps({"name": "chat", "path": paths["chat"], "base_model_name": "elsewhere"}), f"plain={paths['plain']}"])
    processor = SimpleNamespace(lora_config=object(), validate_lora_request=lambda lora: None)  # every adapter fits
    model_config = SimpleNamespace(model="/models/base", max_model_len=64, generation_config="auto",
                                   get_diff_sampling_param=dict)
    engine_client = SimpleNamespace(model_config=model_config, processor=processor,
                                    tokenizer=SimpleNamespace(chat_template=None))
    state = SimpleNamespace()
    init_app_state(state, engine_client, args.served_model_name, None, None, args.lora_modules)
    cards = {card.id: (card.parent, card.root) for card in state.openai_serving_models.show_available_models().data}
    assert cards == {"base": (None, "/models/base"), "alias": (None, "/models/base"), "sql": ("alias", paths["sql"]),
                     "chat": ("base", paths["chat"]), "plain": ("base", paths["plain"])}


def test_load_inplace_replaces_a_served_adapter_under_its_id(tmp_path):
    """vLLM's load_inplace: a name already served takes the new adapter (without it, a 400 that says so) under the
    same id, which the engine reloads (add_lora with load_inplace), so the requests running with it take the new
    weights; the adapter served is named without load_inplace (the engine would reload it at each request). A
    served model's name is never an adapter's."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import lora_router
    from pagedllm.entrypoints.openai.errors import register_exception_handlers
    from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels

    forgotten, loaded = [], []
    processor = SimpleNamespace(lora_config=object(), validate_lora_request=lambda lora: None,
                                forget_lora=forgotten.append)
    app = FastAPI()
    app.include_router(lora_router)
    register_exception_handlers(app)
    app.state.openai_serving_models = models = OpenAIServingModels(["base"], "/models/base", 64,
                                                                   _engine_client(processor, loaded))
    http = TestClient(app)
    v1, v2 = _adapter_dirs(tmp_path, "v1", "v2").values()
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": v1}).status_code == 200
    first = models.lora_request("sql")
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": v2})
    assert response.status_code == 400 and "set 'load_inplace' to True" in response.json()["error"]["message"]
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": v2, "load_inplace": True})
    assert response.status_code == 200, response.text
    again = models.lora_request("sql")
    assert (again.lora_path, again.lora_int_id, again.load_inplace, forgotten) == (v2, first.lora_int_id, False, [])
    assert [(lora.lora_int_id, lora.lora_path, lora.load_inplace) for lora in loaded] == [
        (first.lora_int_id, v1, False), (first.lora_int_id, v2, True)]
    assert [card.root for card in models.show_available_models().data if card.id == "sql"] == [v2]
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": v1,
                                                        "load_inplace": True})
    assert response.status_code == 400 and "conflicts with a served base model" in response.json()["error"]["message"]


def test_refused_loads_and_unloads_answer_as_vllms(tmp_path):
    """vLLM's: a load without a name or a path, naming a served model, or naming a served adapter without load_inplace
    is a 400 of type "InvalidUserInput" and no param; so is an unload without a name, and one of a name not served
    is a 404 NotFoundError. Nothing is loaded."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import lora_router
    from pagedllm.entrypoints.openai.errors import register_exception_handlers
    from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels

    loaded = []
    app = FastAPI()
    app.include_router(lora_router)
    register_exception_handlers(app)
    app.state.openai_serving_models = OpenAIServingModels(["base"], "/models/base", 64, _engine_client(
        SimpleNamespace(lora_config=object(), validate_lora_request=lambda lora: None), loaded))
    http = TestClient(app)
    path = _adapter_dirs(tmp_path, "sql")["sql"]
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": path}).status_code == 200
    invalid = [({"lora_name": "", "lora_path": path}, "Both 'lora_name' and 'lora_path' must be provided."),
               ({"lora_name": "chat", "lora_path": ""}, "Both 'lora_name' and 'lora_path' must be provided."),
               ({"lora_name": "base", "lora_path": path},
                "The lora adapter 'base' conflicts with a served base model."),
               ({"lora_name": "sql", "lora_path": path}, "The lora adapter 'sql' has already been loaded. If you want "
                                                         "to load the adapter in place, set 'load_inplace' to True.")]
    for body, message in invalid:
        response = http.post("/v1/load_lora_adapter", json=body)
        assert (response.status_code, response.json()["error"]) == (
            400, {"message": message, "type": "InvalidUserInput", "param": None, "code": 400})
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": ""})
    assert (response.status_code, response.json()["error"]) == (400, {
        "message": "'lora_name' needs to be provided to unload a LoRA adapter.", "type": "InvalidUserInput",
        "param": None, "code": 400})
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert (response.status_code, response.json()["error"]) == (404, {
        "message": "The lora adapter 'chat' cannot be found.", "type": "NotFoundError", "param": None, "code": 404})
    assert [lora.lora_name for lora in loaded] == ["sql"]


def test_an_adapter_loads_off_the_event_loop(tmp_path):
    """/v1/load_lora_adapter reads and checks the adapter's files (validate_lora_request) on a thread: other requests
    are answered meanwhile (in the loop, a large adapter stalled every stream until it was read)."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import lora_router
    from pagedllm.entrypoints.openai.errors import register_exception_handlers
    from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels

    loading, answered = threading.Event(), threading.Event()

    def validate_lora_request(lora):
        loading.set()
        assert answered.wait(10), "no other request was answered while the adapter loaded"

    app = FastAPI()
    app.include_router(lora_router)
    register_exception_handlers(app)
    processor = SimpleNamespace(lora_config=object(), validate_lora_request=validate_lora_request)
    app.state.openai_serving_models = models = OpenAIServingModels(["base"], "/models/base", 64,
                                                                   _engine_client(processor))
    path = _adapter_dirs(tmp_path, "sql")["sql"]
    loaded = []
    with TestClient(app) as http:  # one event loop for every request
        load = threading.Thread(target=lambda: loaded.append(http.post(
            "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": path}).status_code))
        load.start()
        assert loading.wait(10)
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "other"}).status_code == 404
        answered.set()
        load.join(10)
    assert loaded == [200] and models.lora_request("sql").lora_path == path


def test_loading_a_path_with_no_adapter_is_a_404(tmp_path):
    """vLLM's LoRAAdapterNotFoundError: no adapter_config.json where the path points (no directory, or an empty one)
    is a 404 with its message; an adapter that is there but does not fit stays a 400."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import lora_router
    from pagedllm.entrypoints.openai.errors import register_exception_handlers
    from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
    from pagedllm.lora.peft_helper import PEFTHelper

    processor = SimpleNamespace(lora_config=object(),
                                validate_lora_request=lambda lora: PEFTHelper.from_local_dir(lora.lora_path, 16))
    app = FastAPI()
    app.include_router(lora_router)
    register_exception_handlers(app)
    app.state.openai_serving_models = models = OpenAIServingModels(["base"], "/models/base", 64,
                                                                   _engine_client(processor))
    http = TestClient(app)
    for path in (tmp_path / "nowhere", tmp_path):
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(path)})
        assert response.status_code == 404
        assert response.json()["error"]["message"] == f"Loading lora sql failed: No adapter found for {path}"
    (tmp_path / "adapter_config.json").write_text('{"r": 64, "lora_alpha": 8}')
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(tmp_path)})
    assert response.status_code == 400 and models.lora_request("sql") is None


def test_answers_name_the_first_served_model_whichever_alias_was_asked_for():
    """vLLM's model_name(): a base-model answer's "model" is the first --served-model-name (an adapter's, its own);
    an unknown name is a 404."""
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.errors import NotFoundError
    from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels

    models = OpenAIServingModels(["base", "alias"], "/models/base", 64,
                                 _engine_client(SimpleNamespace(lora_config=None)))
    assert [models.check_model(name) for name in ("base", "alias", None, "")] == ["base"] * 4
    with pytest.raises(NotFoundError):
        models.check_model("elsewhere")


def test_load_lora_adapter_loads_it_into_the_engine_and_unload_drops_it(tmp_path):
    """vLLM's: /v1/load_lora_adapter has the engine load the adapter (add_lora), so weights the engine cannot load
    are this request's error and the adapter is not served (nor kept as checked); /v1/unload_lora_adapter drops it
    from the engine too (remove_lora)."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import lora_router
    from pagedllm.entrypoints.openai.errors import register_exception_handlers
    from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels

    paths = _adapter_dirs(tmp_path, "good", "broken")
    loaded, removed, forgotten = [], [], []
    engine_client = _engine_client(SimpleNamespace(lora_config=object(), validate_lora_request=lambda lora: None,
                                                   forget_lora=forgotten.append), loaded, removed)
    add_lora = engine_client.add_lora

    async def failing_add_lora(lora):
        if lora.lora_path == paths["broken"]:
            raise RuntimeError("ValueError: adapter_model.safetensors: incomplete data")
        return await add_lora(lora)

    engine_client.add_lora = failing_add_lora
    app = FastAPI()
    app.include_router(lora_router)
    register_exception_handlers(app)
    app.state.openai_serving_models = models = OpenAIServingModels(["base"], "/models/base", 64, engine_client)
    http = TestClient(app)
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": paths["broken"]})
    assert response.status_code == 400
    assert "incomplete data" in response.json()["error"]["message"]
    assert models.lora_request("broken") is None and len(forgotten) == 1 and loaded == []
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": paths["good"]}
                     ).status_code == 200
    good = models.lora_request("good")
    assert loaded == [good]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "good"}).status_code == 200
    assert removed == [good.lora_int_id] and models.lora_request("good") is None


def test_the_engine_loads_the_lora_modules_before_the_first_request(tmp_path):
    """vLLM's init_static_loras: the --lora-modules adapters are loaded into the engine (add_lora) when the server
    starts, and one whose weights the engine cannot load stops the start with an error naming it."""
    import asyncio
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels

    paths = _adapter_dirs(tmp_path, "sql", "chat")
    loaded = []
    models = OpenAIServingModels(["base"], "/models/base", 64, _engine_client(SimpleNamespace(
        lora_config=object(), validate_lora_request=lambda lora: None), loaded))
    for name, path in paths.items():
        models.load_lora_adapter(name, path)
    asyncio.run(models.init_static_loras())
    assert [lora.lora_name for lora in loaded] == ["sql", "chat"]

    async def failing_add_lora(lora):
        raise RuntimeError("ValueError: unreadable weights")

    models.engine_client.add_lora = failing_add_lora
    with pytest.raises(ValueError, match="^--lora-modules sql: .*unreadable weights"):
        asyncio.run(models.init_static_loras())
