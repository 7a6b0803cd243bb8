from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Snapshot(_message.Message):
    __slots__ = ("engine_id", "seq", "max_model_len", "time_s", "alloc_ratio", "alloc_slope", "frag_entropy", "queue_len", "prefill_frac", "len_mean", "len_std", "swapped", "decode_ms", "overcommit", "reserved_ratio", "device_free", "queue_hist", "running_hist", "running", "kv_blocks_used", "kv_blocks_total", "kv_footprint_bytes", "oom_events", "preemptions", "tokens_generated", "restarting", "kv_tokens_total", "max_num_seqs", "preempt_mode", "tokens_held", "future_declared", "waiting_tokens", "out_ratio", "future_expected", "waiting_late")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    ALLOC_RATIO_FIELD_NUMBER: _ClassVar[int]
    ALLOC_SLOPE_FIELD_NUMBER: _ClassVar[int]
    FRAG_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FRAC_FIELD_NUMBER: _ClassVar[int]
    LEN_MEAN_FIELD_NUMBER: _ClassVar[int]
    LEN_STD_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    OVERCOMMIT_FIELD_NUMBER: _ClassVar[int]
    RESERVED_RATIO_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FREE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_HIST_FIELD_NUMBER: _ClassVar[int]
    RUNNING_HIST_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OOM_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    RESTARTING_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_MODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    FUTURE_DECLARED_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUT_RATIO_FIELD_NUMBER: _ClassVar[int]
    FUTURE_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    WAITING_LATE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    seq: int
    max_model_len: int
    time_s: float
    alloc_ratio: float
    alloc_slope: float
    frag_entropy: float
    queue_len: int
    prefill_frac: float
    len_mean: float
    len_std: float
    swapped: int
    decode_ms: float
    overcommit: float
    reserved_ratio: float
    device_free: float
    queue_hist: _containers.RepeatedScalarFieldContainer[float]
    running_hist: _containers.RepeatedScalarFieldContainer[float]
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_footprint_bytes: int
    oom_events: int
    preemptions: int
    tokens_generated: int
    restarting: bool
    kv_tokens_total: int
    max_num_seqs: int
    preempt_mode: bool
    tokens_held: int
    future_declared: int
    waiting_tokens: int
    out_ratio: float
    future_expected: float
    waiting_late: int
    def __init__(self, engine_id: _Optional[str] = ..., seq: _Optional[int] = ..., max_model_len: _Optional[int] = ..., time_s: _Optional[float] = ..., alloc_ratio: _Optional[float] = ..., alloc_slope: _Optional[float] = ..., frag_entropy: _Optional[float] = ..., queue_len: _Optional[int] = ..., prefill_frac: _Optional[float] = ..., len_mean: _Optional[float] = ..., len_std: _Optional[float] = ..., swapped: _Optional[int] = ..., decode_ms: _Optional[float] = ..., overcommit: _Optional[float] = ..., reserved_ratio: _Optional[float] = ..., device_free: _Optional[float] = ..., queue_hist: _Optional[_Iterable[float]] = ..., running_hist: _Optional[_Iterable[float]] = ..., running: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_footprint_bytes: _Optional[int] = ..., oom_events: _Optional[int] = ..., preemptions: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., restarting: bool = ..., kv_tokens_total: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., preempt_mode: bool = ..., tokens_held: _Optional[int] = ..., future_declared: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., out_ratio: _Optional[float] = ..., future_expected: _Optional[float] = ..., waiting_late: _Optional[int] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("seq", "action", "action_name", "overcommit", "shield_override", "policy_action", "policy_hash", "admit_headroom")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ACTION_NAME_FIELD_NUMBER: _ClassVar[int]
    OVERCOMMIT_FIELD_NUMBER: _ClassVar[int]
    SHIELD_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    POLICY_ACTION_FIELD_NUMBER: _ClassVar[int]
    POLICY_HASH_FIELD_NUMBER: _ClassVar[int]
    ADMIT_HEADROOM_FIELD_NUMBER: _ClassVar[int]
    seq: int
    action: int
    action_name: str
    overcommit: float
    shield_override: bool
    policy_action: int
    policy_hash: str
    admit_headroom: float
    def __init__(self, seq: _Optional[int] = ..., action: _Optional[int] = ..., action_name: _Optional[str] = ..., overcommit: _Optional[float] = ..., shield_override: bool = ..., policy_action: _Optional[int] = ..., policy_hash: _Optional[str] = ..., admit_headroom: _Optional[float] = ...) -> None: ...

class EngineState(_message.Message):
    __slots__ = ("snapshot", "mps_limit_bytes", "held_bytes", "share")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    MPS_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    snapshot: Snapshot
    mps_limit_bytes: int
    held_bytes: int
    share: float
    def __init__(self, snapshot: _Optional[_Union[Snapshot, _Mapping]] = ..., mps_limit_bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ..., share: _Optional[float] = ...) -> None: ...

class NodeSnapshot(_message.Message):
    __slots__ = ("seq", "device_capacity_bytes", "device_free_bytes", "engines")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    device_capacity_bytes: int
    device_free_bytes: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineState]
    def __init__(self, seq: _Optional[int] = ..., device_capacity_bytes: _Optional[int] = ..., device_free_bytes: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineState, _Mapping]]] = ...) -> None: ...

class NodeDecision(_message.Message):
    __slots__ = ("seq", "action", "action_name", "engine_id", "engine_action", "shield_override", "policy_action", "policy_hash")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ACTION_NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ACTION_FIELD_NUMBER: _ClassVar[int]
    SHIELD_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    POLICY_ACTION_FIELD_NUMBER: _ClassVar[int]
    POLICY_HASH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    action: int
    action_name: str
    engine_id: str
    engine_action: str
    shield_override: bool
    policy_action: int
    policy_hash: str
    def __init__(self, seq: _Optional[int] = ..., action: _Optional[int] = ..., action_name: _Optional[str] = ..., engine_id: _Optional[str] = ..., engine_action: _Optional[str] = ..., shield_override: bool = ..., policy_action: _Optional[int] = ..., policy_hash: _Optional[str] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyInfo(_message.Message):
    __slots__ = ("spec", "name", "kind", "file_sha256", "policy_hash", "features", "actions", "scales", "max_model_len", "pinned_overcommit", "source_commit", "blind_to")
    class ScalesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FILE_SHA256_FIELD_NUMBER: _ClassVar[int]
    POLICY_HASH_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PINNED_OVERCOMMIT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_COMMIT_FIELD_NUMBER: _ClassVar[int]
    BLIND_TO_FIELD_NUMBER: _ClassVar[int]
    spec: str
    name: str
    kind: str
    file_sha256: str
    policy_hash: str
    features: _containers.RepeatedScalarFieldContainer[str]
    actions: _containers.RepeatedScalarFieldContainer[str]
    scales: _containers.ScalarMap[str, float]
    max_model_len: int
    pinned_overcommit: float
    source_commit: str
    blind_to: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, spec: _Optional[str] = ..., name: _Optional[str] = ..., kind: _Optional[str] = ..., file_sha256: _Optional[str] = ..., policy_hash: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ..., actions: _Optional[_Iterable[str]] = ..., scales: _Optional[_Mapping[str, float]] = ..., max_model_len: _Optional[int] = ..., pinned_overcommit: _Optional[float] = ..., source_commit: _Optional[str] = ..., blind_to: _Optional[_Iterable[str]] = ...) -> None: ...

class ReloadPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...

class ReloadPolicyResponse(_message.Message):
    __slots__ = ("previous", "current")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    previous: PolicyInfo
    current: PolicyInfo
    def __init__(self, previous: _Optional[_Union[PolicyInfo, _Mapping]] = ..., current: _Optional[_Union[PolicyInfo, _Mapping]] = ...) -> None: ...
