"""``--policy-module``: a policy from a file or module of its own is registered once, offered by
the server's and the generation CLI's choices, decodes losslessly, and every failure names the
module (and takes back what a half-imported module registered)."""

import re
import sys

import pytest

from ddtree_jax import generate, policies, policy_modules
from ddtree_jax import serve as serve_cli

POLICY_FILE = '''
from ddtree_jax import policies


@policies.register_policy("{name}")
def {name}(root_tokens, start, ids, logprobs, budget, max_depth=None):
  # The chain: the drafter's top-1 token at each depth.
  return policies.get_policy("chain")(root_tokens, start, ids, logprobs, budget, max_depth)
'''


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
  """Each test registers into a copy of the registry, and the modules it imported leave
  sys.modules after it, so no test policy or module outlives its test."""
  monkeypatch.setattr(policies, "_POLICIES", dict(policies._POLICIES))  # pylint: disable=protected-access
  monkeypatch.setattr(policy_modules, "_LOADED", {})
  before = set(sys.modules)
  yield
  for name in set(sys.modules) - before:
    if name.startswith(("_ddtree_policy_module_", "lab_policies")):
      del sys.modules[name]


def policy_file(tmp_path, name, body=POLICY_FILE):
  path = tmp_path / f"{name}_policies.py"
  path.write_text(body.format(name=name))
  return path


def test_a_file_registers_its_policies_once(tmp_path):
  path = policy_file(tmp_path, "my_chain")
  assert "my_chain" not in policies.available_policies()
  assert policy_modules.load_policy_module(str(path)) == ("my_chain",)
  assert "my_chain" in policies.available_policies()
  assert policy_modules.load_policy_module(str(path)) == ("my_chain",)  # again: not re-imported (no duplicate)


def test_a_dotted_module_registers_its_policies_also_when_imported_before(tmp_path, monkeypatch):
  package = tmp_path / "lab_policies"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "trees.py").write_text(POLICY_FILE.format(name="lab_chain"))
  (package / "more.py").write_text("from lab_policies import trees\n" + POLICY_FILE.format(name="lab_more"))
  monkeypatch.syspath_prepend(str(tmp_path))
  assert policy_modules.load_policy_module("lab_policies.more") == ("lab_chain", "lab_more")  # trees came along
  assert policy_modules.load_policy_module("lab_policies.trees") == ("lab_chain",)  # imported already: its own


@pytest.mark.parametrize("body,message", [
    (None, "no such file"),
    ("raise RuntimeError('bad import')", "failed to import: RuntimeError: bad import"),
    ("import sys\nsys.exit('bye')", "failed to import: SystemExit: bye"),  # it used to end the process
    ("x = 1", "registered no policy"),
    (POLICY_FILE.format(name="chain"), "failed to import: ValueError: policy 'chain' is already registered"),
])
def test_failures_name_the_module(tmp_path, body, message):
  path = tmp_path / "broken.py"
  if body is not None:
    path.write_text(body)
  with pytest.raises(ValueError, match=f"policy module {re.escape(repr(str(path)))}.*{message}"):
    policy_modules.load_policy_module(str(path))


def test_a_missing_dotted_module_is_named():
  with pytest.raises(ValueError, match="policy module 'no_such_package.policies' failed to import: "
                                       "ModuleNotFoundError"):
    policy_modules.load_policy_module("no_such_package.policies")


def test_a_module_failing_after_registering_takes_its_policies_back(tmp_path):
  path = tmp_path / "half.py"
  path.write_text(POLICY_FILE.format(name="half_chain") + "\nraise RuntimeError('later')\n")
  for _ in range(2):  # the retry meets the real error again, not "already registered"
    with pytest.raises(ValueError, match="failed to import: RuntimeError: later"):
      policy_modules.load_policy_module(str(path))
    assert "half_chain" not in policies.available_policies()
  # A policy it replaced before failing (replace=True) comes back as it was.
  chain = policies._POLICIES["chain"]  # pylint: disable=protected-access
  path.write_text("from ddtree_jax import policies\n"
                  "policies.register_policy('chain', replace=True)(lambda *a, **k: None)\n"
                  "raise RuntimeError('later')\n")
  policy_modules._LOADED.clear()  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="failed to import: RuntimeError: later"):
    policy_modules.load_policy_module(str(path))
  assert policies._POLICIES["chain"] is chain  # pylint: disable=protected-access


def test_policy_options_are_json_without_nan_or_infinity():
  assert policy_modules.parse_options(["width=4", "name=x", "ranks=[1, 2]"]) == {
      "width": 4, "name": "x", "ranks": [1, 2]}
  for text in ("NaN", "Infinity", "-Infinity"):
    with pytest.raises(ValueError, match=f"--policy-option 'floor={text}': {text} is not a number"):
      policy_modules.parse_options([f"floor={text}"])


def test_the_server_offers_module_policies_as_spec(tmp_path, capsys):
  first, second = policy_file(tmp_path, "served_chain"), policy_file(tmp_path, "other_chain")
  config, args = serve_cli.parse_args(["--policy-module", str(first), "--policy-module", str(second),
                                       "--spec", "other_chain"])
  assert config.spec == "other_chain" and args.policy_module == [str(first), str(second)]
  assert {"served_chain", "other_chain"} <= set(policies.available_policies())
  missing = tmp_path / "missing.py"
  for argv, message in (
      (["--policy-module", str(missing), "--spec", "served_chain"],
       f"python -m ddtree_jax.serve: error: policy module '{missing}': no such file"),
      # An abbreviation would skip the pass that imports the modules: refused as a whole.
      (["--policy-mod", str(first)], "unrecognized argument --policy-mod: the flag is --policy-module"),
      # ... also when the policy it names comes first and would be reported as an unknown choice.
      (["--spec", "nowhere_chain", f"--policy-modul={first}"], "unrecognized argument --policy-modul:")):
    with pytest.raises(SystemExit) as exit_info:
      serve_cli.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_generate_decodes_losslessly_with_a_module_policy(tmp_path, capsys):
  path = policy_file(tmp_path, "cli_chain")
  # test_generate_cli's short run, so that the plain decoding's executables are shared with it.
  code = generate.main(["--policy-module", str(path), "--policy", "cli_chain", "--max-new-tokens", "12",
                        "--budget", "4", "--prompt", "import json"])
  out = capsys.readouterr().out
  assert code == 0
  assert "policy cli_chain, budget 4, float32: 12 tokens" in out
  assert "speculative output identical (greedy)" in out
