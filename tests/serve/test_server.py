"""The real server on loopback, with the bundled demo pair in float32 on the CPU.

Two servers: ``--spec ddtree`` in this process (so tests can look inside its engine) and
``--spec none`` started as ``python -m ddtree_jax.serve`` in a subprocess. Greedy text equality
follows DESIGN's near-tie rule in float32 (1e-4), checked against plain greedy decoding.
"""

import concurrent.futures as cf
import json
import logging
import os
import random
import re
import socket
import threading
import time

import httpx
import jax
import numpy as np
import openai
import psutil
import pytest

from ddtree_jax.near_tie import check_near_ties, greedy_reference
from models import cache as cache_lib
from models import forward as fwd
from models import loading
from serve.config import ServeConfig
from serve.engine_loop import FaultInjector
from serve.launch import ServerThread, server_process

MAX_CONTEXT = 192
# Three batch buckets (not the default five): the budget table's sizes, fewer step shapes to compile.
COMMON = dict(max_batch=16, batch_buckets="1,4,16", max_context=MAX_CONTEXT, dtype="float32", max_queue=64)
SPEC = ServeConfig(port=0, spec="ddtree", budget="1:16,4:8,16:4", **COMMON)
SOAK_REQUESTS = int(os.environ.get("DDTREE_SOAK_REQUESTS", "160"))


@pytest.fixture(scope="module")
def plain_server():
  """``python -m ddtree_jax.serve --spec none`` in a subprocess. Its batch is 4 (``--batch-buckets
  1,4``: the largest bucket sets ``--max-batch``), so the tests' 16 concurrent clients also queue
  there. It computes no log-probabilities (``--max-logprobs -1``). Yields (url, the /health answers
  seen while it started)."""
  statuses = []
  args = ["--spec", "none", "--batch-buckets", "1,4", "--max-context", str(MAX_CONTEXT), "--dtype", "float32",
          "--max-logprobs", "-1", "--log-level", "warning"]
  with server_process(args, ready_timeout=600, health_seen=statuses) as url:
    yield url, statuses


@pytest.fixture(scope="module")
def server(plain_server):
  with ServerThread(SPEC) as s:
    yield s


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def held_out():
  path = loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json"
  return [p["tokens"][:64] for p in json.loads(path.read_text())["prompts"][:20]]


def metric(url: str, name: str, labels: str = "") -> float:
  text = httpx.get(url + "/metrics").text
  pattern = re.escape(name + (("{" + labels + "}") if labels else "")) + r" ([0-9.e+-]+)$"
  found = re.search(pattern, text, re.M)
  return float(found.group(1)) if found else 0.0


def hold_admissions(monkeypatch):
  """(entered, release): admissions wait inside ``Batch.admit`` until ``release`` is set;
  ``entered`` is set once the engine is inside the first."""
  from ddtree_jax import engine as engine_lib
  entered, release = threading.Event(), threading.Event()
  admit = engine_lib.Batch.admit

  def held(batch, request):
    entered.set()
    release.wait(60)
    return admit(batch, request)
  monkeypatch.setattr(engine_lib.Batch, "admit", held)
  return entered, release


def wait_idle(server, timeout=60.0) -> dict:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    snap = server.engine.loop.snapshot()
    if snap["running"] == snap["waiting"] == snap["queued"] == snap["jobs"] == 0:
      return snap
    time.sleep(0.05)
  raise AssertionError(f"engine not idle after {timeout} s: {server.engine.loop.snapshot()}")


# ---- startup and the OpenAI client ---------------------------------------------------------------
def test_cli_server_reports_loading_then_ready(plain_server):
  url, statuses = plain_server
  assert (503, "loading") in statuses and statuses[-1] == (200, "ok")
  models = httpx.get(url + "/v1/models").json()
  assert models["data"][0]["id"] == "kimi-demo" and models["data"][0]["spec"] == "none"
  # The warm-up request ran through the engine but is not traffic: no request, token or step counted.
  for name in ("ddtree_prompt_tokens_total", "ddtree_generated_tokens_total", "ddtree_acceptance_length_count"):
    assert metric(url, name) == 0, name
  assert "ddtree_step_seconds_count{" not in httpx.get(url + "/metrics").text  # no budget's step observed
  assert all(metric(url, "ddtree_finished_requests_total", f'reason="{r}"') == 0
             for r in ("stop", "length", "cancelled", "error"))
  assert re.search(r"^ddtree_generated_tokens_total ", httpx.get(url + "/metrics").text, re.M)  # really exported


def test_openai_client_completions_chat_and_streaming_agree(server, client):
  prompt = 'def read_config(path):\n    """Read a JSON file."""'
  full = client.completions.create(model="kimi-demo", prompt=prompt, max_tokens=40, temperature=0)
  chunks = list(client.completions.create(model="kimi-demo", prompt=prompt, max_tokens=40, temperature=0,
                                          stream=True, stream_options={"include_usage": True}))
  streamed = "".join(c.choices[0].text for c in chunks if c.choices)
  assert full.choices[0].text == streamed and len(streamed) > 20
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
  assert full.usage.prompt_tokens == len(server.engine.codec.completion_prompt(prompt))
  finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
  assert finals == [full.choices[0].finish_reason] and full.choices[0].finish_reason in ("stop", "length")

  messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A parser."}]
  chat = client.chat.completions.create(model="kimi-demo", messages=messages, max_tokens=24, temperature=0)
  stream = list(client.chat.completions.create(model="kimi-demo", messages=messages, max_tokens=24,
                                               temperature=0, stream=True))
  assert stream[0].choices[0].delta.role == "assistant"
  assert chat.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in stream)
  assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 24
  assert chat.choices[0].finish_reason == stream[-1].choices[0].finish_reason


def test_stop_string_gives_the_same_tokens_and_usage_with_and_without_speculation(server, plain_server):
  """A ddtree step may emit tokens past a stop string; the reply must not show them."""
  prompt = "import os\nimport sys\n"
  base = httpx.post(plain_server[0] + "/v1/completions", json={"prompt": prompt, "max_tokens": 60,
                                                               "temperature": 0, "return_token_ids": True}).json()
  text = base["choices"][0]["text"]
  stops = [text[i:i + 3] for i in (7, 23, 41) if len(text) >= i + 3 and text[i:i + 3].strip()]
  assert stops, text
  for stop in stops:
    replies = []
    generated = metric(server.url, "ddtree_generated_tokens_total")
    for url in (plain_server[0], server.url):
      body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "stop": [stop], "return_token_ids": True}
      replies.append(httpx.post(url + "/v1/completions", json=body).json())
    (plain, spec) = replies
    # The metric counts what the reply reports, not the tokens a step speculated past the stop.
    assert metric(server.url, "ddtree_generated_tokens_total") - generated == spec["usage"]["completion_tokens"]
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"] == text[:text.find(stop)]
    assert spec["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert spec["usage"] == plain["usage"] and spec["choices"][0]["finish_reason"] == "stop"
    # Streamed, the chunks' ids add up to the same ids: none past the stop string.
    streamed = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
      for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
          streamed += json.loads(line[6:])["choices"][0].get("token_ids", [])
    assert streamed == spec["choices"][0]["token_ids"]
    # The stop string completed by the very last allowed token still reports "stop".
    body.update(max_tokens=spec["usage"]["completion_tokens"])
    last = httpx.post(server.url + "/v1/completions", json=body).json()
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["text"] == spec["choices"][0]["text"]


def test_a_requested_stop_token_id_ends_the_text_after_its_own(server):
  """A ``stop_token_ids`` entry that spells text ends the request with its text included (as vLLM
  returns it), so text, ``token_ids`` and ``usage`` hold the same tokens, streamed or not."""
  url = server.url + "/v1/completions"
  body = {"prompt": "import os\nimport sys\n", "max_tokens": 24, "temperature": 0, "return_token_ids": True}
  ids = httpx.post(url, json=body).json()["choices"][0]["token_ids"]
  codec = server.engine.codec
  stop_id = next(t for t in ids[3:] if codec.decode([t]).strip())
  through = ids.index(stop_id) + 1
  reply = httpx.post(url, json={**body, "stop_token_ids": [stop_id]}).json()
  choice = reply["choices"][0]
  assert choice["finish_reason"] == "stop" and choice["token_ids"] == ids[:through]
  assert choice["text"] == codec.decode(ids[:through]) != codec.decode(ids[:through - 1])  # its text included
  assert reply["usage"]["completion_tokens"] == through
  streamed = []
  with httpx.stream("POST", url, json={**body, "stop_token_ids": [stop_id], "stream": True}, timeout=300) as r:
    for line in r.iter_lines():
      if line.startswith("data: ") and line != "data: [DONE]":
        streamed.append(json.loads(line[6:])["choices"][0]["text"])
  assert "".join(streamed) == choice["text"]


def teacher_forced_logprobs(server, prompt_ids, token_ids):
  """float64 log_softmax of the server's target at each generated token, from one plain prefill of
  prompt + generated tokens (no tree, no drafter, no engine)."""
  target = server.engine.loop.decoder.target
  sequence = list(prompt_ids) + list(token_ids)
  cache = cache_lib.init_cache(target.cfg, 1, MAX_CONTEXT + 32)
  with fwd.matmul_precision(target.cfg):
    _, logits, _, _ = fwd.prefill(target, [sequence], np.arange(1), cache, chunk_size=32, all_logits=True)
  z = np.asarray(logits, np.float64)[0, len(prompt_ids) - 1:len(sequence) - 1]
  z -= z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_logprobs_in_both_formats_equal_the_target_and_stream_as_they_return(server, plain_server, client):
  """Each generated token's logprob (float32, the demo target) against a teacher-forced float64
  reference; the alternatives are the reference's most likely tokens; streaming sends the same
  entries once each, up to a stop string that cuts a speculative step; the limits are named."""
  codec = server.engine.codec
  prompt = 'def read_config(path):\n    """Read a JSON file."""'
  body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "logprobs": 3, "return_token_ids": True,
          "ignore_eos": True}
  full = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
  ids, lp = full["token_ids"], full["logprobs"]
  assert len(ids) == 32 and len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 32
  ref = teacher_forced_logprobs(server, codec.completion_prompt(prompt), ids)
  np.testing.assert_allclose(lp["token_logprobs"], ref[np.arange(32), ids], atol=2e-4)
  shown = lambda token_id: _shown(codec.token_bytes(int(token_id)))
  for t, (token_id, top) in enumerate(zip(ids, lp["top_logprobs"])):
    assert lp["tokens"][t] == shown(token_id)
    # The three most likely tokens and the chosen one (greedy: among them), each with its logprob.
    order = np.argsort(-ref[t], kind="stable")
    if ref[t, order[2]] - ref[t, order[3]] > 2e-4:  # no near tie at the cut
      assert set(top) == {shown(i) for i in order[:3]}
    for token_id_ in order[:3]:
      if shown(token_id_) in top:
        assert abs(top[shown(token_id_)] - ref[t, token_id_]) < 2e-4
    assert max(top.values()) == lp["token_logprobs"][t]
  offsets = lp["text_offset"]
  assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(full["text"])

  # Streamed with a stop string that falls inside the text: the blocks add up to the entries of the
  # tokens the reply reports, none past the stop string, each sent once.
  stop = full["text"][40:43]
  assert stop.strip(), full["text"]
  cut = httpx.post(server.url + "/v1/completions", json={**body, "stop": [stop]}).json()
  n = cut["usage"]["completion_tokens"]
  assert cut["choices"][0]["finish_reason"] == "stop" and len(cut["choices"][0]["logprobs"]["tokens"]) == n < 32
  streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
  with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stop": [stop], "stream": True},
                    timeout=300) as r:
    for line in r.iter_lines():
      if line.startswith("data: ") and line != "data: [DONE]":
        block = json.loads(line[6:])["choices"][0]["logprobs"]
        for key in streamed:
          streamed[key] += block[key] if block else []
  assert streamed["tokens"] == lp["tokens"][:n] and streamed["text_offset"] == offsets[:n]
  np.testing.assert_allclose(streamed["token_logprobs"], lp["token_logprobs"][:n], atol=1e-5)

  # echo with logprobs, as lm-eval's loglikelihood requests send it: the prompt's entries first (its
  # first token's null), then the generated token's, one teacher-forced reference for all.
  echo = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
  echoed = httpx.post(server.url + "/v1/completions", json=echo).json()["choices"][0]
  prompt_ids = codec.completion_prompt(prompt)
  e = echoed["logprobs"]
  assert len(e["tokens"]) == len(prompt_ids) + 1 and e["token_logprobs"][0] is None and e["top_logprobs"][0] is None
  assert echoed["text"] == prompt + full["text"][:len(echoed["text"]) - len(prompt)]
  whole = teacher_forced_logprobs(server, prompt_ids[:1], prompt_ids[1:] + ids[:1])
  np.testing.assert_allclose(e["token_logprobs"][1:], whole[np.arange(len(prompt_ids)), prompt_ids[1:] + ids[:1]],
                             atol=2e-4)
  assert all(len(top) <= 2 for top in e["top_logprobs"][1:])
  assert e["text_offset"][0] == 0 and e["text_offset"][-1] == len(prompt)  # ASCII: characters of the prompt
  with httpx.stream("POST", server.url + "/v1/completions", json={**echo, "stream": True}, timeout=300) as r:
    chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
  head = chunks[0]["choices"][0]
  assert head["text"] == prompt and "token_ids" not in head
  for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
    assert head["logprobs"][key] == e[key][:-1], key
  tail = [c["choices"][0]["logprobs"] for c in chunks[1:] if c["choices"] and c["choices"][0]["logprobs"]]
  assert [t for block in tail for t in block["tokens"]] == e["tokens"][-1:]
  assert [o for block in tail for o in block["text_offset"]] == [len(prompt)]  # offsets run on from the echo

  # Chat through the OpenAI client: content entries whose bytes rebuild the reply.
  messages = [{"role": "user", "content": "Write a parser."}]
  chat = client.chat.completions.create(model="kimi-demo", messages=messages, max_tokens=20, temperature=0,
                                        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
  content = chat.choices[0].logprobs.content
  assert len(content) == chat.usage.completion_tokens == 20
  assert bytes(b for entry in content for b in entry.bytes).decode() == chat.choices[0].message.content
  assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
  assert all(e.logprob == e.top_logprobs[0].logprob and e.token == e.top_logprobs[0].token for e in content)
  plain = client.chat.completions.create(model="kimi-demo", messages=messages, max_tokens=4, temperature=0,
                                         logprobs=True)
  assert len(plain.choices[0].logprobs.content) == 4 and all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
  # Streamed, the chunks' content entries add up to the same entries.
  chunks = list(client.chat.completions.create(model="kimi-demo", messages=messages, max_tokens=20, temperature=0,
                                               logprobs=True, top_logprobs=2, stream=True,
                                               extra_body={"ignore_eos": True}))
  streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
  assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
  np.testing.assert_allclose([e.logprob for e in streamed], [e.logprob for e in content], atol=1e-5)
  no_lp = client.chat.completions.create(model="kimi-demo", messages=messages, max_tokens=4, temperature=0)
  assert no_lp.choices[0].logprobs is None

  # More than the server computes, and a server that computes none: 400s naming the limit.
  over = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "logprobs": True,
                                                               "top_logprobs": 6})
  assert over.status_code == 400 and over.json()["error"]["param"] == "top_logprobs"
  assert "--max-logprobs 5" in over.json()["error"]["message"]
  off = httpx.post(plain_server[0] + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 0})
  assert off.status_code == 400 and "--max-logprobs -1" in off.json()["error"]["message"], off.text


def _shown(raw: bytes) -> str:
  """A token as a logprobs entry shows it: its text, or OpenAI's ``bytes:\\xNN`` form for a piece
  of a character."""
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_stop_strings_and_echo(client):
  prompt = "import os\nimport sys\n"
  base = client.completions.create(model="kimi-demo", prompt=prompt, max_tokens=48, temperature=0).choices[0].text
  cut = base.find("\n", 3)
  assert cut > 0, base
  stop = base[cut:cut + 2]
  stopped = client.completions.create(model="kimi-demo", prompt=prompt, max_tokens=48, temperature=0, stop=[stop])
  assert stopped.choices[0].text == base[:base.find(stop)] and stopped.choices[0].finish_reason == "stop"
  echoed = client.completions.create(model="kimi-demo", prompt=prompt, max_tokens=8, temperature=0, echo=True)
  assert echoed.choices[0].text.startswith(prompt) and echoed.choices[0].text[len(prompt):] == base[:len(
      echoed.choices[0].text) - len(prompt)]


# ---- losslessness under concurrency ------------------------------------------------------------
def test_greedy_ddtree_server_equals_plain_server_with_16_concurrent_clients(server, plain_server, held_out):
  plain_url, _ = plain_server
  accepted_before = (metric(server.url, "ddtree_acceptance_length_sum"),
                     metric(server.url, "ddtree_acceptance_length_count"))

  def ask(url, prompt):
    body = {"model": "kimi-demo", "prompt": prompt, "max_tokens": 48, "temperature": 0, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]

  with cf.ThreadPoolExecutor(16) as pool:
    spec = list(pool.map(lambda p: ask(server.url, p), held_out))
    plain = list(pool.map(lambda p: ask(plain_url, p), held_out))
  spec_ids = [c["token_ids"] for c in spec]
  plain_ids = [c["token_ids"] for c in plain]
  target = server.engine.loop.decoder.target
  reference = greedy_reference(target, held_out, 48, MAX_CONTEXT + 32)
  # Both servers stop at EOS; compare each against the reference cut to its own length.
  cut = lambda ref, ids: [r[:len(i)] if i and i[-1] == 0 else r for r, i in zip(ref, ids)]
  check_near_ties(spec_ids, cut(reference[0], spec_ids), reference[1], context="ddtree server")
  check_near_ties(plain_ids, cut(reference[0], plain_ids), reference[1], context="plain server")
  same = sum(a["text"] == b["text"] for a, b in zip(spec, plain))
  assert same >= len(held_out) - 1  # at most a counted near tie may separate them
  total, count = (metric(server.url, "ddtree_acceptance_length_sum") - accepted_before[0],
                  metric(server.url, "ddtree_acceptance_length_count") - accepted_before[1])
  assert count > 0 and total / count > 2.0, f"ddtree server accepted only {total / max(count, 1):.2f} per step"


def test_long_prompt_prefills_in_chunks_and_stays_lossless(server, held_out):
  # 170 prompt tokens: three 64-token prefill chunks, the last one partial.
  prompt = (held_out[0] + held_out[1] + held_out[2])[:170]
  body = {"prompt": prompt, "max_tokens": MAX_CONTEXT - 170, "temperature": 0, "return_token_ids": True,
          "ignore_eos": True}
  r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
  assert r.status_code == 200, r.text
  got = r.json()["choices"][0]["token_ids"]
  assert len(got) == MAX_CONTEXT - 170 and r.json()["usage"]["prompt_tokens"] == 170
  reference = greedy_reference(server.engine.loop.decoder.target, [prompt], len(got), MAX_CONTEXT + 32)
  check_near_ties([got], *reference, context="long prompt")


# ---- many clients, sampling, disconnects ---------------------------------------------------------
def test_32_concurrent_streaming_clients_with_mixed_sampling(server):
  rng = random.Random(5)
  jobs = [dict(prompt=f"def f{i}(x):\n    return", max_tokens=rng.randint(4, 40),
               temperature=rng.choice([0.0, 0.5, 1.0]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]),
               seed=rng.randrange(2**31), stop=rng.choice([None, ["\n\n"]]), stream=True,
               stream_options={"include_usage": True}) for i in range(32)]

  def run(body):
    text, usage, finish = [], None, None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
      assert r.status_code == 200
      for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        if chunk["choices"]:
          text.append(chunk["choices"][0]["text"])
          finish = chunk["choices"][0]["finish_reason"] or finish
        else:
          usage = chunk["usage"]
    return "".join(text), usage, finish

  steps_before = {b: metric(server.url, "ddtree_step_seconds_count", f'budget="{b}"') for b in (4, 8, 16)}
  with cf.ThreadPoolExecutor(32) as pool:
    results = list(pool.map(run, jobs))
  # The budget follows the running batch: 16 rows run at budget 4 (table "1:16,4:8,16:4"), and the
  # batch's tail, as requests finish, at the larger budgets of smaller buckets.
  steps = {b: metric(server.url, "ddtree_step_seconds_count", f'budget="{b}"') - steps_before[b] for b in (4, 8, 16)}
  assert steps[4] > 0 and steps[8] + steps[16] > 0, steps
  for body, (text, usage, finish) in zip(jobs, results):
    assert finish in ("stop", "length") and 1 <= usage["completion_tokens"] <= body["max_tokens"]
    assert finish == "stop" or usage["completion_tokens"] == body["max_tokens"]
  # A seeded request's text does not depend on the batch it shared.
  for body, (text, _, _) in list(zip(jobs, results))[:4]:
    alone = run(dict(body))
    assert alone[0] == text
  assert wait_idle(server)["free_slots"] == server.engine.loop.decoder.num_slots


def test_client_disconnect_mid_stream_frees_its_slot(server):
  num_slots = server.engine.loop.decoder.num_slots
  cancelled_before = metric(server.url, "ddtree_finished_requests_total", 'reason="cancelled"')
  body = {"prompt": "class Parser:\n", "max_tokens": 150, "temperature": 0.0, "stream": True, "ignore_eos": True}
  with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
    lines = r.iter_lines()
    next(l for l in lines if l.startswith("data: "))
    assert server.engine.loop.snapshot()["running"] == 1
  deadline = time.monotonic() + 30
  while metric(server.url, "ddtree_free_slots") != num_slots and time.monotonic() < deadline:
    time.sleep(0.05)
  assert metric(server.url, "ddtree_free_slots") == num_slots
  assert metric(server.url, "ddtree_finished_requests_total", 'reason="cancelled"') == cancelled_before + 1
  assert server.engine.loop.snapshot()["jobs"] == 0
  # A non-streaming client that gives up (here: a read timeout) is noticed too.
  body.update(stream=False, max_tokens=180)
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
  deadline = time.monotonic() + 30
  while metric(server.url, "ddtree_finished_requests_total", 'reason="cancelled"') < cancelled_before + 2:
    assert time.monotonic() < deadline, "the abandoned non-streaming request was not cancelled"
    time.sleep(0.05)
  assert wait_idle(server)["free_slots"] == num_slots


# ---- bad input -------------------------------------------------------------------------------------
def test_bad_requests_get_openai_errors(server):
  url = server.url + "/v1/completions"
  cases = [
      (b"{not json", 400, None), (b'{"prompt": ["a", "b"]}', 400, "prompt"), (b'{"max_tokens": 3}', 400, "prompt"),
      (b'{"prompt": "x", "max_tokens": -2}', 400, "max_tokens"), (b'{"prompt": "x", "temperature": -1}', 400,
                                                                  "temperature"),
      (b'{"prompt": "x", "top_p": 0}', 400, "top_p"), (b'{"prompt": "x", "n": 3}', 400, "n"),
      (b'{"prompt": "x", "model": "gpt-9"}', 404, "model"),
      (json.dumps({"prompt": "x" * 10, "max_tokens": MAX_CONTEXT}).encode(), 400, "max_tokens"),
  ]
  for raw, status, param in cases:
    r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, (raw, r.text)
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
  for raw in (b'{"prompt": "x", "temperature": NaN}', b"[" * 100_000):
    r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("malformed JSON"), r.text
  long = httpx.post(url, json={"prompt": "x" * 10, "max_tokens": MAX_CONTEXT})
  assert "maximum context length is 192" in long.json()["error"]["message"]
  assert "max_tokens is 192" in long.json()["error"]["message"]
  r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                            "presence_penalty": 1.0})
  assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty"


def test_edges_of_the_openai_surface(server):
  """Unknown routes and methods answer in OpenAI's error shape, a model can be retrieved by id,
  lone surrogates are a 400 (not a 500 from the tokenizer), and a message name is refused, not dropped."""
  probe = httpx.head(server.url + "/health")  # as load balancers probe
  assert probe.status_code == 200 and not probe.content
  nope = httpx.get(server.url + "/v1/nope")
  assert nope.status_code == 404 and nope.json()["error"]["message"] == "GET /v1/nope: Not Found"
  wrong = httpx.get(server.url + "/v1/completions")
  assert wrong.status_code == 405 and "Method Not Allowed" in wrong.json()["error"]["message"]
  assert wrong.json()["error"]["type"] == "invalid_request_error"
  one = httpx.get(server.url + "/v1/models/kimi-demo").json()
  assert one["id"] == "kimi-demo" and one["object"] == "model"
  missing = httpx.get(server.url + "/v1/models/other")
  assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
  url = server.url + "/v1/completions"
  # Any 64-bit seed, as OpenAI takes it, used modulo 2**32 (-1 and 2**32 - 1 draw alike).
  sampled = lambda seed: httpx.post(url, json={"prompt": "import", "max_tokens": 8, "temperature": 1.0,
                                               "seed": seed, "ignore_eos": True})
  low, high = sampled(-1), sampled(2**32 - 1)
  assert low.status_code == high.status_code == 200 and low.json()["choices"] == high.json()["choices"]
  assert sampled(2**63).status_code == 400 and "seed must be a 64-bit integer" in sampled(2**63).text
  for raw in (b'{"prompt": "\\ud800abc", "max_tokens": 2}', b'{"prompt": "x", "model": "\\udfff"}',
              b'{"messages": [{"role": "user", "content": "\\udfff"}]}'):
    target = url if b"prompt" in raw else server.url + "/v1/chat/completions"
    r = httpx.post(target, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "lone UTF-16 surrogate" in r.json()["error"]["message"], r.text
  chat = server.url + "/v1/chat/completions"
  named = httpx.post(chat, json={"messages": [{"role": "user", "content": "hi", "name": "ann"}], "max_tokens": 2})
  assert named.status_code == 400 and named.json()["error"]["param"] == "messages.0.name"
  full = httpx.post(chat, json={"messages": [{"role": "user", "content": "x " * 400}]})
  assert full.status_code == 400 and full.json()["error"]["code"] == "context_length_exceeded", full.text


def test_unexpected_errors_and_abandoned_bodies_are_counted_by_status(server, monkeypatch, caplog):
  """A handler's unexpected exception is a 500 with OpenAI's body, counted in ddtree_requests_total;
  a client that leaves while sending its body is a 499 (nobody reads it), not a logged error."""
  requests_with = lambda status: metric(server.url, "ddtree_requests_total",
                                        f'endpoint="/v1/completions",status="{status}"')
  before = {status: requests_with(status) for status in (499, 500)}

  def broken(_prompt):
    raise RuntimeError("simulated bug")
  monkeypatch.setattr(server.engine.codec, "completion_prompt", broken)
  r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
  assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: RuntimeError: simulated bug"
  assert r.json()["error"]["type"] == "server_error"
  assert requests_with(500) - before[500] == 1
  monkeypatch.undo()
  caplog.clear()
  host, port = server.url.removeprefix("http://").split(":")
  for _ in range(2):
    with socket.create_connection((host, int(port))) as conn:
      conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
      time.sleep(0.2)
  deadline = time.monotonic() + 10
  while requests_with(499) - before[499] < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
  assert requests_with(499) - before[499] == 2 and requests_with(500) - before[500] == 1
  assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text
  assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_api_key_body_limit_and_full_queue(server):
  keyed = ServeConfig(port=0, api_key="s3cret", max_body_bytes=2048, **{**COMMON, "max_queue": 0})
  with ServerThread(keyed, engine=server.engine) as other:
    body = {"prompt": "x", "max_tokens": 2}
    assert httpx.post(other.url + "/v1/completions", json=body).status_code == 401
    wrong = httpx.post(other.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    for header in ("Basic s3cret", "s3cret", "Bearer s3cret2", "Bearer S3CRET"):
      assert httpx.get(other.url + "/v1/models", headers={"Authorization": header}).status_code == 401, header
    assert httpx.get(other.url + "/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
    auth = {"Authorization": "Bearer s3cret"}
    assert httpx.get(other.url + "/v1/models", headers=auth).status_code == 200
    assert httpx.get(other.url + "/health").status_code == 200  # health and metrics need no key
    big = httpx.post(other.url + "/v1/completions", json={"prompt": "x" * 4000}, headers=auth)
    assert big.status_code == 413 and "2048" in big.json()["error"]["message"]
  # A full queue. The engine is held inside a step (a test hook in place of the fault injector), so
  # submitted requests stay queued: with max_queue 0, as many as there are free rows (all but the
  # running request's) are taken, the next one gets 429, and all the taken ones complete once the
  # engine goes on.
  loop = server.engine.loop
  wait_idle(server)

  class Stall:
    def __init__(self):
      self.entered, self.release = threading.Event(), threading.Event()

    def before_step(self):
      self.entered.set()
      self.release.wait(60)

  stall, saved = Stall(), loop.max_queue
  loop.faults, loop.max_queue = stall, 0
  with cf.ThreadPoolExecutor(loop.decoder.max_batch + 1) as pool:
    try:
      futures = [pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=120)]
      assert stall.entered.wait(30)
      futures += [pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=120)
                  for _ in range(loop.decoder.max_batch - 1)]
      deadline = time.monotonic() + 30
      while loop.snapshot()["queued"] < loop.decoder.max_batch - 1 and time.monotonic() < deadline:
        time.sleep(0.02)
      r = httpx.post(server.url + "/v1/completions", json=body)
      assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
    finally:
      loop.faults, loop.max_queue = None, saved
      stall.release.set()
    assert [f.result().status_code for f in futures] == [200] * loop.decoder.max_batch
  assert wait_idle(server)["free_slots"] == loop.decoder.num_slots
  assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200


def test_a_request_being_admitted_still_counts_against_the_queue(server, monkeypatch):
  """Burst while a prompt is prefilled into its row: that request counts as queued until it runs, so
  at most max_batch + max_queue requests are taken, however the burst falls around admissions."""
  loop, body = server.engine.loop, {"prompt": "x", "max_tokens": 2}
  wait_idle(server)
  entered, release = hold_admissions(monkeypatch)
  saved = loop.max_queue
  loop.max_queue = 0
  rows = loop.decoder.max_batch
  post = lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code
  with cf.ThreadPoolExecutor(rows + 3) as pool:
    try:
      first = pool.submit(post)
      assert entered.wait(30)  # the engine is inside the first request's admission
      burst = [pool.submit(post) for _ in range(rows + 2)]
      deadline = time.monotonic() + 30
      while sum(f.done() for f in burst) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    finally:
      release.set()
      loop.max_queue = saved
    statuses = [first.result()] + [f.result() for f in burst]
  assert statuses.count(200) == rows and statuses.count(429) == 3, statuses
  assert wait_idle(server)["free_slots"] == loop.decoder.num_slots


def test_a_bucket_admitting_fewer_than_planned_runs_a_budget_it_was_compiled_for(server, monkeypatch):
  """The bucket is chosen for the running and waiting requests, and admission may then take fewer
  (here one prompt a turn): the step must still run at a budget compiled for that bucket. Under
  "1:16,4:8,16:4" with buckets 1, 4 and 16, bucket 16 holds only budget 4, while 2 running
  requests would ask for 8."""
  loop, rows = server.engine.loop, 8
  assert loop.decoder.batch_buckets == (1, 4, 16)
  wait_idle(server)
  failures = metric(server.url, "ddtree_engine_failures_total")
  entered, release = hold_admissions(monkeypatch)
  monkeypatch.setattr(loop, "prefill_tokens_per_turn", 1)  # one prompt a turn
  body = {"prompt": "def g():", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
  post = lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=120)
  with cf.ThreadPoolExecutor(rows) as pool:
    try:
      first = pool.submit(post)
      assert entered.wait(30)
      rest = [pool.submit(post) for _ in range(rows - 1)]
      deadline = time.monotonic() + 30  # all of them waiting, so the next turn plans bucket 16
      while loop.snapshot()["queued"] < rows and time.monotonic() < deadline:
        time.sleep(0.02)
    finally:
      release.set()
    replies = [first.result()] + [f.result() for f in rest]
  assert [r.status_code for r in replies] == [200] * rows, [r.text for r in replies if r.status_code != 200]
  assert {r.json()["choices"][0]["text"] for r in replies} == {replies[0].json()["choices"][0]["text"]}
  assert metric(server.url, "ddtree_engine_failures_total") == failures
  assert wait_idle(server)["free_slots"] == loop.decoder.num_slots


def test_engine_fault_fails_only_its_step_and_the_server_goes_on(server):
  loop = server.engine.loop
  wait_idle(server)
  loop.faults = FaultInjector(steps=[1])  # the next step fails: the request in it gets a 500
  r = httpx.post(server.url + "/v1/completions", json={"prompt": "def g():", "max_tokens": 20, "temperature": 0})
  assert r.status_code == 500 and "injected engine fault" in r.json()["error"]["message"]
  # A stream that has started gets an SSE error event, then the end of the stream.
  loop.faults = FaultInjector(steps=[6])
  body = {"prompt": "def g():", "max_tokens": 100, "temperature": 0, "stream": True, "ignore_eos": True}
  with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
    assert r.status_code == 200
    data = [l[6:] for l in r.iter_lines() if l.startswith("data: ")]
  assert data[-1] == "[DONE]" and "injected engine fault" in json.loads(data[-2])["error"]["message"]
  assert any(json.loads(d).get("choices") for d in data[:-2])  # text arrived before the failure
  loop.faults = None
  assert wait_idle(server)["free_slots"] == loop.decoder.num_slots
  short = {"prompt": "def g():", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
  ok = httpx.post(server.url + "/v1/completions", json=short)
  assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 12

  # A failure that consumed the caches (as a step that donated them and then failed would): the
  # loop rebuilds them, and the next request decodes exactly as before.
  class ConsumeCaches:
    def before_step(self):
      loop.faults = None
      for leaf in jax.tree.leaves((loop.decoder.target_cache, loop.decoder.drafter_state)):
        leaf.delete()
      raise RuntimeError("simulated failure after donation")

  loop.faults = ConsumeCaches()
  failed = httpx.post(server.url + "/v1/completions", json=short)
  assert failed.status_code == 500 and "simulated failure" in failed.json()["error"]["message"]
  again = httpx.post(server.url + "/v1/completions", json=short)
  assert again.status_code == 200 and again.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]


# ---- soak ----------------------------------------------------------------------------------------------
def test_soak_random_requests_disconnects_bad_input_and_faults(server):
  """Many short requests with random parameters, random disconnects, bad requests and injected
  faults: every request gets exactly one outcome, every slot ends free, memory stays bounded.
  Length: $DDTREE_SOAK_REQUESTS (default 160; the issue's few thousand with 3000)."""
  loop = server.engine.loop
  wait_idle(server)
  process = psutil.Process()
  rss_before = process.memory_info().rss
  finished_before = sum(metric(server.url, "ddtree_finished_requests_total", f'reason="{r}"')
                        for r in ("stop", "length", "cancelled", "error"))
  loop.faults = FaultInjector(steps=range(10, 100_000, 30))  # every 30th step from the 10th fails
  rng = random.Random(1234)
  outcomes: dict[int, str] = {}
  lock = threading.Lock()
  accepted_by_engine = []

  def one(i: int):
    kind = rng.random()
    body = {"prompt": rng.choice(["x", "def h(", "import re\n", "for i in range(3):\n   "]) * rng.randint(1, 6),
            "max_tokens": rng.randint(1, 12), "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(1000),
            "top_p": rng.choice([1.0, 0.8]), "stream": rng.random() < 0.5}
    if kind < 0.05:
      body["temperature"] = -1  # bad request
    with httpx.Client(timeout=120) as http:
      if kind < 0.05:
        r = http.post(server.url + "/v1/completions", json=body)
        outcome = f"bad:{r.status_code}"
      elif kind < 0.12:  # disconnect mid-stream
        body.update(stream=True, max_tokens=40, ignore_eos=True)
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
          outcome = "500" if r.status_code == 500 else "disconnected"
          for line in r.iter_lines():
            if line.startswith("data: "):
              break
      else:
        if body["stream"]:
          with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            data = [l[6:] for l in r.iter_lines() if l.startswith("data: ")] if r.status_code == 200 else []
            if r.status_code != 200:
              outcome = str(r.status_code)
            elif data[-1] == "[DONE]" and any("error" in json.loads(d) for d in data[:-1]):
              outcome = "stream-error"
            else:
              assert data[-1] == "[DONE]"
              finals = [json.loads(d)["choices"][0]["finish_reason"] for d in data[:-1]]
              assert [f for f in finals if f] in (["stop"], ["length"]), finals
              outcome = "ok"
        else:
          r = http.post(server.url + "/v1/completions", json=body)
          outcome = "ok" if r.status_code == 200 else str(r.status_code)
          if r.status_code == 200:
            assert 1 <= r.json()["usage"]["completion_tokens"] <= body["max_tokens"]
    with lock:
      assert i not in outcomes
      outcomes[i] = outcome
      if not outcome.startswith("bad"):
        accepted_by_engine.append(i)

  with cf.ThreadPoolExecutor(24) as pool:
    for future in [pool.submit(one, i) for i in range(SOAK_REQUESTS)]:
      future.result()
  loop.faults, faults = None, loop.faults
  snap = wait_idle(server)
  counts = {k: sum(1 for v in outcomes.values() if v == k) for k in set(outcomes.values())}
  assert len(outcomes) == SOAK_REQUESTS, counts
  assert set(counts) <= {"ok", "500", "stream-error", "disconnected", "bad:400"}, counts
  assert counts.get("ok", 0) >= 0.7 * SOAK_REQUESTS, counts
  # Faults did happen, and their requests got errors (those of other steps did not: they are "ok").
  assert faults.injected > 0 and counts.get("500", 0) + counts.get("stream-error", 0) > 0, (faults.injected, counts)
  print(f"soak: {SOAK_REQUESTS} requests, {faults.injected} injected faults, outcomes {counts}")
  assert snap["free_slots"] == snap["num_slots"]
  finished_after = sum(metric(server.url, "ddtree_finished_requests_total", f'reason="{r}"')
                       for r in ("stop", "length", "cancelled", "error"))
  # Every request the engine took left it exactly once (none lost, none counted twice).
  assert finished_after - finished_before == len(accepted_by_engine), (counts, finished_after - finished_before)
  growth = process.memory_info().rss - rss_before
  print(f"soak: resident memory grew by {growth / 2**20:.0f} MiB")
  assert growth < 256 * 2**20, f"resident memory grew by {growth / 2**20:.0f} MiB over the soak"


def test_serving_never_compiled_after_warmup(server, plain_server):
  # Runs last in this module: every prompt length, batch size, bucket change and fault above.
  assert metric(server.url, "ddtree_compiles_after_warmup_total") == 0
  assert metric(plain_server[0], "ddtree_compiles_after_warmup_total") == 0
