"""Policy files (agents/export.py): a trained DQN exported and reloaded acts exactly as it did,
the file holds no pickle and states everything needed to use it, and a file that is cut, corrupted,
foreign or made for another observation layout, action set or network is refused by name."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load as load_tensors
from safetensors.torch import save_file

from agents.networks import NumpyQNetwork, q_network
from experiments import SCENARIOS
from agents.spec import make_policy
from agents.dqn import OvercommitDQN
from agents.export import (ENSEMBLE_VERSION, FORMAT, HEADER_KEY, POLICY_SUFFIX, VERSION, ExportedPolicy,
                           PolicyFileError, _sha256, export_ensemble, export_policy, load_policy)
from env.observation import FEATURES, HIGH, LOW
from engine.control import ACTIONS
from env.overcommit_env import OvercommitEnv
from env.scenario_yaml import scenario_from_dict

NET_ARCH = (32, 16)


def short_burst(**changes):
    data = yaml.safe_load((SCENARIOS / "burst.yaml").read_text())
    return scenario_from_dict({**data, "name": "burst", "max_steps": 5, **changes})


@pytest.fixture(scope="module", params=[True, False], ids=["dueling", "plain"])
def trained(request, tmp_path_factory):
    """(model, scenario, policy file, header, training config): a short DQN run, exported."""
    scenario = short_burst()
    config = {"total_timesteps": 300, "learning_starts": 50, "net_arch": list(NET_ARCH), "dueling": request.param,
              "run_dir": tmp_path_factory.getbasetemp()}  # a Path: recorded as its text
    model = OvercommitDQN(env=OvercommitEnv(scenario), dueling=request.param, net_arch=NET_ARCH, learning_starts=50,
                          buffer_size=1000, batch_size=32, train_freq=4, target_update_interval=50, seed=0,
                          device="cpu")
    model.learn(300)
    path = tmp_path_factory.mktemp("export") / f"burst-{request.param}{POLICY_SUFFIX}"
    header = export_policy(model, path, scenario=scenario, training_config=config)
    return model, scenario, path, header, config


def observations(n: int = 200, seed: int = 0) -> np.ndarray:
    space = OvercommitEnv(short_burst()).observation_space
    space.seed(seed)
    return np.stack([space.sample() for _ in range(n)])


# ---- round trip --------------------------------------------------------------------------------
def test_the_reloaded_policy_acts_and_values_exactly_as_the_trained_network(trained):
    model, _, path, _, _ = trained
    policy = load_policy(path)
    obs = observations()
    with torch.no_grad():
        expected = model.policy.q_net(torch.from_numpy(obs)).numpy()
    assert np.allclose(policy.q_values(obs), expected, atol=1e-6)
    assert [policy.act(o) for o in obs] == list(expected.argmax(axis=1))
    assert [policy.act(o) for o in obs] == [int(model.predict(o, deterministic=True)[0]) for o in obs]
    assert np.allclose(policy.q_values(obs[0]), expected[0], atol=1e-6)
    assert len(set(expected.argmax(axis=1))) > 1 or np.ptp(expected) > 0  # the check is not vacuous


@pytest.mark.parametrize("net_arch, dueling", [([32, 16], False), ([32, 16], True), ([64], True), ([64], False),
                                                ([128, 128], True), ([256, 128, 64], False)])
def test_the_numpy_forward_gives_torchs_q_values_and_greedy_actions(net_arch, dueling):
    torch.manual_seed(len(net_arch) * 10 + dueling)
    network = q_network(len(FEATURES), len(ACTIONS), net_arch, dueling).eval()
    with torch.no_grad():  # weights larger than the initialisation's, so the Q-values spread and mostly differ
        for p in network.parameters():
            p.mul_(3.0)
    obs = np.concatenate([observations(2000, seed=1), np.stack([LOW, HIGH])])
    with torch.no_grad():
        expected = network(torch.from_numpy(obs)).numpy()
    got = NumpyQNetwork(network)(obs)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    top2 = np.sort(expected, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4 * np.abs(expected).max()  # a float32 near-tie may break either way
    assert clear.mean() > 0.99
    assert (got.argmax(axis=1) == expected.argmax(axis=1))[clear].all()
    assert len(set(expected.argmax(axis=1))) > 1  # the check is not vacuous


def test_the_numpy_forward_refuses_a_network_q_network_does_not_build():
    odd = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()), torch.nn.Linear(8, 3))
    with pytest.raises(TypeError, match="unexpected layer Tanh"):
        NumpyQNetwork(odd)
    no_relu = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 8)), torch.nn.Linear(8, 3))
    with pytest.raises(TypeError, match="unexpected layers"):  # a trunk must end in a ReLU, as mlp() builds it
        NumpyQNetwork(no_relu)


def test_the_file_holds_no_pickle_and_loads_with_unpickling_disabled(trained, monkeypatch):
    _, _, path, _, _ = trained
    data = path.read_bytes()
    # neither torch's zip nor a pickle (protocol 2-5 opens with 0x80 and the protocol number)
    assert not data.startswith(b"PK\x03\x04") and not (data[0] == 0x80 and 2 <= data[1] <= 5)

    def refuse(*args, **kwargs):
        raise AssertionError("the loader unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert isinstance(load_policy(path), ExportedPolicy)


def test_the_header_states_layout_actions_network_training_scenario_commit_and_checksums(trained):
    model, scenario, path, header, config = trained
    assert header["format"] == FORMAT == "rlctl-policy" and header["version"] == VERSION == 2
    obs = header["observation"]
    assert obs["features"] == list(FEATURES)
    assert obs["low"] == [float(x) for x in LOW] and obs["high"] == [float(x) for x in HIGH]
    assert obs["scales"] == dataclasses.asdict(scenario.observation)
    assert "max_model_len" not in obs  # version 2's features are shares of the KV capacity, no deployment's length
    assert header["actions"] == list(ACTIONS)
    assert header["network"] == {"obs_dim": len(FEATURES), "n_actions": len(ACTIONS), "net_arch": list(NET_ARCH),
                                 "dueling": config["dueling"]}
    assert header["training"] == {**config, "run_dir": str(config["run_dir"])}
    assert header["scenario"] == {"name": "burst", "deployment": scenario.deployment}
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    assert header["source_commit"] == (git.stdout.strip() if git.returncode == 0 else "unknown")
    state = model.policy.q_net.q_net.state_dict()
    assert header["weights"]["dtype"] == "float32"
    assert header["weights"]["sha256"] == {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in state.items()}

    policy = load_policy(path)
    assert policy.header == header
    assert policy.name == path.stem and policy.engine_overrides == {}
    assert policy.file_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    policy.check_scenario(scenario)


def test_a_given_source_commit_is_recorded(trained, tmp_path):
    model, scenario, _, _, _ = trained
    header = export_policy(model, tmp_path / "p.rlpolicy", scenario=scenario, training_config={}, source_commit="abc123")
    assert header["source_commit"] == "abc123" == load_policy(tmp_path / "p.rlpolicy").header["source_commit"]


def test_act_refuses_an_observation_of_the_wrong_shape(trained):
    policy = load_policy(trained[2])
    for bad in (np.zeros(len(FEATURES) - 1, np.float32), np.zeros((1, len(FEATURES)), np.float32), np.zeros(0)):
        with pytest.raises(ValueError, match=rf"shape \({len(FEATURES)},\)"):
            policy.act(bad)
    with pytest.raises(ValueError, match="non-finite"):
        policy.act(np.full(len(FEATURES), np.nan, np.float32))


def test_a_scenario_with_other_observation_scales_is_refused_naming_the_scale(trained):
    policy = load_policy(trained[2])
    with pytest.raises(PolicyFileError, match="observation.queue_scale"):
        policy.check_scenario(short_burst(observation={"queue_scale": 64}))


def test_make_policy_loads_a_policy_file_and_names_a_missing_one(trained, tmp_path):
    _, _, path, _, _ = trained
    for spec in (str(path), path):
        policy = make_policy(spec)
        assert isinstance(policy, ExportedPolicy) and policy.file_sha256 == load_policy(path).file_sha256
    with pytest.raises(PolicyFileError, match=r"nope\.rlpolicy: no such file"):
        make_policy("nope.rlpolicy")
    with pytest.raises(ValueError, match="or a policy file"):
        make_policy("greedy")
    other = tmp_path / "weights.bin"  # an existing file under another name is read as a policy file too
    other.write_bytes(path.read_bytes())
    assert make_policy(str(other)).act(observations(1)[0]) == load_policy(path).act(observations(1)[0])


def test_a_shipped_policy_loads_by_name_and_an_unknown_name_lists_the_shipped_ones(trained, tmp_path, monkeypatch):
    import agents.spec

    _, _, path, _, _ = trained
    (tmp_path / f"steady{POLICY_SUFFIX}").write_bytes(path.read_bytes())
    monkeypatch.setattr(agents.spec, "POLICIES", tmp_path)  # experiments/policies/, as installed
    assert make_policy("steady").file_sha256 == load_policy(path).file_sha256
    with pytest.raises(ValueError, match=r"or a shipped policy: steady$"):
        make_policy("burst")


# ---- refusals ----------------------------------------------------------------------------------
def refused(path: Path, match: str) -> str:
    with pytest.raises(PolicyFileError, match=match) as err:
        load_policy(path)
    assert str(path) in str(err.value)
    return str(err.value)


def rewritten(src: Path, dst: Path, header_edit=None, tensor_edit=None) -> Path:
    """A copy of policy file ``src`` with its header and/or tensors changed (checksums left as they were)."""
    data = src.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(json.loads(data[8:8 + n])["__metadata__"][HEADER_KEY])
    tensors = load_tensors(data)
    if header_edit:
        header_edit(header)
    if tensor_edit:
        tensor_edit(tensors)
    save_file(tensors, dst, metadata={HEADER_KEY: json.dumps(header)})
    return dst


def test_a_missing_path_or_a_directory_is_refused(tmp_path):
    refused(tmp_path / "gone.rlpolicy", "no such file")
    refused(tmp_path, "not a file")


def test_a_truncated_file_is_refused(trained, tmp_path):
    data = trained[2].read_bytes()
    for cut in (len(data) // 2, len(data) - 1):
        (tmp_path / "cut.rlpolicy").write_bytes(data[:cut])
        refused(tmp_path / "cut.rlpolicy", "truncated")
    (tmp_path / "cut.rlpolicy").write_bytes(data[:40])  # inside the JSON header
    refused(tmp_path / "cut.rlpolicy", "truncated")


def test_corrupted_weight_bytes_fail_the_checksum_naming_the_weight(trained, tmp_path):
    data = bytearray(trained[2].read_bytes())
    n = int.from_bytes(data[:8], "little")
    layout = {k: v["data_offsets"] for k, v in json.loads(data[8:8 + n]).items() if k != "__metadata__"}
    name, (start, end) = max(layout.items(), key=lambda kv: kv[1][1] - kv[1][0])  # the largest weight
    data[8 + n + (start + end) // 2] ^= 0xFF
    (tmp_path / "bad.rlpolicy").write_bytes(bytes(data))
    refused(tmp_path / "bad.rlpolicy", rf"checksum mismatch for weight '{name}'")


def test_a_file_that_is_not_a_policy_is_refused(tmp_path):
    text = tmp_path / "notes.rlpolicy"
    text.write_text("these are not the weights you are looking for\n" * 20)
    refused(text, "not an rlctl policy file")
    (tmp_path / "empty.rlpolicy").write_bytes(b"")
    refused(tmp_path / "empty.rlpolicy", "not an rlctl policy file")
    plain = tmp_path / "plain.safetensors"
    save_file({"weight": torch.zeros(3, 3)}, plain)
    refused(plain, "not an rlctl policy file .*without an 'rlctl' header")
    save_file({"weight": torch.zeros(3, 3)}, plain, metadata={HEADER_KEY: json.dumps({"format": "other"})})
    refused(plain, "not an rlctl policy file .*format 'other'")


def test_an_unsupported_format_version_is_refused(trained, tmp_path):
    path = rewritten(trained[2], tmp_path / "v9.rlpolicy", header_edit=lambda h: h.update(version=9))
    refused(path, "unsupported format version 9 .*reads versions 2, 3")


def test_another_observation_layout_is_refused_naming_the_first_difference(trained, tmp_path):
    def rename(h):
        h["observation"]["features"][3] = "queue_length"

    def swap(h):
        f = h["observation"]["features"]
        f[3], f[4] = f[4], f[3]

    def bound(h):
        h["observation"]["high"][8] = 2.0

    refused(rewritten(trained[2], tmp_path / "a.rlpolicy", rename),
            "observation layout differs.*feature 3 is 'queue_length', which this build does not have")
    refused(rewritten(trained[2], tmp_path / "b.rlpolicy", swap),
            f"observation layout differs.*feature 4 is '{FEATURES[3]}', out of this build's order")
    refused(rewritten(trained[2], tmp_path / "c.rlpolicy", bound), "high bound of 'len_std' is 2.0")


def test_a_policy_trained_before_a_feature_existed_loads_blind_to_it_and_acts_as_it_did(trained, tmp_path):
    from agents.export import _sha256, blind_network

    missing = FEATURES.index("expected_ratio")
    keep = [i for i in range(len(FEATURES)) if i != missing]

    def older_header(h):  # the layout before expected_ratio, as such a file states it
        for key in ("features", "low", "high"):
            h["observation"][key] = [h["observation"][key][i] for i in keep]
        h["network"]["obs_dim"] = len(keep)

    def older_weights(t):
        t["0.0.weight"] = t["0.0.weight"][:, keep].contiguous()

    def checksums(path):
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(json.loads(data[8:8 + n])["__metadata__"][HEADER_KEY])
        tensors = load_tensors(data)
        header["weights"]["sha256"] = {k: _sha256(v) for k, v in tensors.items()}
        save_file(tensors, path, metadata={HEADER_KEY: json.dumps(header)})
        return path

    old = checksums(rewritten(trained[2], tmp_path / "old.rlpolicy", older_header, older_weights))
    policy, original = load_policy(old), load_policy(trained[2])
    assert policy.blind_to == ["expected_ratio"] and original.blind_to == [] and original.inputs is None
    assert policy.obs_dim == len(FEATURES) and list(policy.inputs) == keep
    obs = np.random.default_rng(0).uniform(LOW, HIGH, size=(64, len(FEATURES))).astype(np.float32)
    moved = obs.copy()
    moved[:, missing] = 1.0 - moved[:, missing]
    q_old = policy.q_values(obs)
    # what its own network computes on the features it knows, to the bit, whatever the new one says
    assert np.array_equal(q_old, policy.q_values(moved))
    assert np.array_equal(q_old, NumpyQNetwork(policy.networks[0])(obs[:, keep]))
    assert [policy.act(o) for o in obs] == [int(np.argmax(q)) for q in q_old]
    ref = obs.copy()
    ref[:, missing] = 0.0
    assert np.allclose(q_old, original.q_values(ref), atol=1e-5)
    assert not np.allclose(original.q_values(obs), original.q_values(moved), atol=1e-7)
    # widened for fine-tuning: zero weights on the new feature, the same Q-values to float rounding
    wide = blind_network(policy.networks[0], policy.inputs, policy.obs_dim)
    assert wide[0][0].weight.shape == (NET_ARCH[0], len(FEATURES)) and not wide[0][0].weight[:, missing].any()
    with torch.no_grad():
        assert np.allclose(wide(torch.from_numpy(moved)).numpy(), q_old, atol=1e-5)
    assert policy.networks[0][0][0].weight.shape == (NET_ARCH[0], len(keep))  # the loaded one untouched
    # an old file with its checksums unmended is still refused
    refused(rewritten(trained[2], tmp_path / "bad.rlpolicy", older_header, older_weights), "checksum mismatch")


def test_another_action_set_is_refused_with_the_counts(trained, tmp_path):
    def fewer(h):
        h["actions"].pop()
        h["network"]["n_actions"] -= 1

    def renamed(h):
        h["actions"][3] = "compact"

    refused(rewritten(trained[2], tmp_path / "a.rlpolicy", fewer),
            f"{len(ACTIONS) - 1} actions .*this build has {len(ACTIONS)}")
    refused(rewritten(trained[2], tmp_path / "b.rlpolicy", renamed), "entry 3 is 'compact', this build has 'defrag'")


def test_weights_that_do_not_fit_the_described_network_are_refused_naming_the_tensor(trained, tmp_path):
    def wider(t):
        t["0.0.weight"] = torch.zeros(NET_ARCH[0] + 1, len(FEATURES))

    def missing(t):
        del t["0.0.bias"]

    def extra(t):
        t["2.weight"] = torch.zeros(1)

    refused(rewritten(trained[2], tmp_path / "a.rlpolicy", tensor_edit=wider),
            rf"weight '0\.0\.weight' has shape \({NET_ARCH[0] + 1}, {len(FEATURES)}\).* needs \({NET_ARCH[0]}, {len(FEATURES)}\)")
    refused(rewritten(trained[2], tmp_path / "b.rlpolicy", tensor_edit=missing), r"weight '0\.0\.bias' is missing")
    refused(rewritten(trained[2], tmp_path / "c.rlpolicy", tensor_edit=extra), r"weight '2\.weight' is not part")
    arch = rewritten(trained[2], tmp_path / "d.rlpolicy", header_edit=lambda h: h["network"].update(net_arch=[64, 16]))
    refused(arch, r"weight '0\.0\.weight' has shape")


def test_a_header_with_a_shape_or_switch_of_the_wrong_type_is_refused_saying_so(trained, tmp_path):
    """ "39" read as 39, and "false" as true (a dueling file built as another network): each named."""
    for name, edit, why in (("dim", {"obs_dim": str(len(FEATURES))}, rf"network.obs_dim must be a whole number, got '{len(FEATURES)}'"),
                            ("acts", {"n_actions": 5.0}, r"network.n_actions must be a whole number, got 5.0"),
                            ("duel", {"dueling": "false"}, r"network.dueling must be true or false, got 'false'")):
        refused(rewritten(trained[2], tmp_path / f"{name}.rlpolicy", header_edit=lambda h: h["network"].update(edit)),
                why)


def test_observation_scales_that_are_not_finite_positive_numbers_are_refused_saying_so(trained, tmp_path):
    # found by review: negative scales loaded silently (flipping what the network reads) and a zero one
    # crashed rlctl serve with a ZeroDivisionError
    for name, value in (("slope_scale", 0), ("overcommit_scale", -16.0), ("queue_scale", float("inf")),
                        ("swapped_scale", "256"), ("slope_scale", True)):
        path = rewritten(trained[2], tmp_path / f"{name}.rlpolicy",
                         header_edit=lambda h: h["observation"]["scales"].update({name: value}))
        refused(path, rf"observation.scales.{name} must be a finite number > 0, got {re.escape(repr(value))}")
    path = rewritten(trained[2], tmp_path / "extra.rlpolicy",
                     header_edit=lambda h: h["observation"]["scales"].update(kv_scale=2.0))
    refused(path, r"observation.scales must map some of \['queue_scale'")


def test_a_header_naming_a_huge_network_is_refused_without_building_it(trained, tmp_path):
    # 10^6 x 10^6 float32 weights would be 4 TB: built before the tensors were checked, it could not load at all
    huge = rewritten(trained[2], tmp_path / "huge.rlpolicy",
                     header_edit=lambda h: h["network"].update(net_arch=[10 ** 6, 10 ** 6]))
    refused(huge, r"weight '0\.0\.weight' has shape \(\d+, \d+\), the network the header describes needs \(1000000, ")


def test_non_finite_weights_are_refused_and_non_finite_q_values_raise(trained, tmp_path):
    def poison(t):
        t["0.0.bias"][3] = float("nan")

    def checksummed(h):  # the file as an exporter would write it, checksums and all
        h["weights"]["sha256"]["0.0.bias"] = _sha256(bias)

    bias = load_tensors(trained[2].read_bytes())["0.0.bias"].clone()
    bias[3] = float("nan")
    bad = rewritten(trained[2], tmp_path / "nan.rlpolicy", header_edit=checksummed, tensor_edit=poison)
    refused(bad, r"weight '0\.0\.bias' has non-finite entries")
    policy = load_policy(trained[2])
    with torch.no_grad():
        for network in policy.networks:
            network[0][0].weight.fill_(3e38)  # finite, but its products overflow
    policy.forward = None  # the torch path, on the weights just changed
    with pytest.raises(ValueError, match="non-finite Q-values"):
        policy.act(np.ones(policy.obs_dim, dtype=np.float32))


def test_a_damaged_safetensors_header_is_refused_as_corrupted(trained, tmp_path):
    data = trained[2].read_bytes()
    n = int.from_bytes(data[:8], "little")
    i = data.index(b'"F32"')
    (tmp_path / "dtype.rlpolicy").write_bytes(data[:i] + b'"F16"' + data[i + 5:])  # sizes no longer add up
    refused(tmp_path / "dtype.rlpolicy", "corrupted safetensors data")
    (tmp_path / "json.rlpolicy").write_bytes(data[:8 + n // 2] + b"\x00" + data[8 + n // 2 + 1:])
    refused(tmp_path / "json.rlpolicy", "corrupted: the safetensors header is not valid JSON")


# ---- ensembles ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ensemble(trained, tmp_path_factory):
    """(ensemble file, its members' files): the trained network and a second one trained on another seed."""
    model, scenario, path, _, config = trained
    other = OvercommitDQN(env=OvercommitEnv(scenario), dueling=model.policy.q_net.dueling, net_arch=NET_ARCH,
                          learning_starts=50, buffer_size=1000, batch_size=32, train_freq=4, target_update_interval=50,
                          seed=1, device="cpu")
    other.learn(300)
    tmp = tmp_path_factory.mktemp("ensemble")
    second = tmp / f"second{POLICY_SUFFIX}"
    export_policy(other, second, scenario=scenario, training_config={**config, "seed": 1})
    out = tmp / f"both{POLICY_SUFFIX}"
    export_ensemble([path, second], out, training_config={"members": 2})
    return out, [path, second]


def test_an_ensemble_acts_on_the_mean_of_its_members_q_values(ensemble):
    path, members = ensemble
    policy, (a, b) = load_policy(path), [load_policy(m) for m in members]
    obs = observations()
    qa, qb = a.q_values(obs), b.q_values(obs)
    assert not np.allclose(qa, qb)
    assert np.allclose(policy.q_values(obs), (qa + qb) / 2, atol=1e-6)
    assert [policy.act(o) for o in obs] == list(((qa + qb) / 2).argmax(axis=1))
    # rlctl eval/results/compare --jobs send the policy to worker processes
    assert np.array_equal(pickle.loads(pickle.dumps(policy)).q_values(obs), policy.q_values(obs))
    torch_path = ExportedPolicy(path, policy.header, policy.networks, policy.file_sha256)
    torch_path.forward = None  # a network too big for the numpy forward acts through torch: the same mean
    assert np.allclose(torch_path.q_values(obs), policy.q_values(obs), atol=1e-5)
    header = policy.header
    assert header["version"] == ENSEMBLE_VERSION and header["network"]["members"] == 2
    assert [m["sha256"] for m in header["members"]] == [a.file_sha256, b.file_sha256]
    assert [m["seed"] for m in header["members"]] == [None, 1]  # what each member's training recorded
    assert header["observation"] == a.header["observation"] and header["training"] == {"members": 2}


def test_an_ensemble_is_refused_what_does_not_belong_in_it(ensemble, tmp_path):
    path, members = ensemble
    with pytest.raises(ValueError, match="at least 2 members"):
        export_ensemble(members[:1], tmp_path / "one.rlpolicy", training_config={})
    with pytest.raises(ValueError, match=r"is itself an ensemble of 2"):
        export_ensemble([members[0], path], tmp_path / "nested.rlpolicy", training_config={})
    wider = rewritten(members[1], tmp_path / "wider.rlpolicy",
                      header_edit=lambda h: h["observation"]["scales"].update(queue_scale=64))
    with pytest.raises(ValueError, match="differ in 'observation'"):
        export_ensemble([members[0], wider], tmp_path / "mixed.rlpolicy", training_config={})
    assert not (tmp_path / "mixed.rlpolicy").exists()


def test_a_damaged_ensemble_file_is_refused_naming_what_is_wrong(ensemble, tmp_path):
    path, _ = ensemble
    refused(rewritten(path, tmp_path / "a.rlpolicy", header_edit=lambda h: h["network"].update(members=1)),
            "network.members must be an integer >= 2")
    refused(rewritten(path, tmp_path / "b.rlpolicy", header_edit=lambda h: h["members"].pop()),
            "members must list the 2 members")
    refused(rewritten(path, tmp_path / "c.rlpolicy", tensor_edit=lambda t: t.pop(sorted(t)[-1])),
            r"weight 'members\.1\..*' is missing")
    refused(rewritten(path, tmp_path / "d.rlpolicy", header_edit=lambda h: h.update(version=4)),
            "unsupported format version 4")
