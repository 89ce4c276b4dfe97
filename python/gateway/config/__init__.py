"""The gateway's configuration (SPEC §8): typed, defaulted, environment-expanded, validated.

`load_config(path)` / `parse_config(text)` turn YAML into a frozen `Config` or raise one
`ConfigError` whose `errors` list every mistake of the file, each naming the offending field,
e.g. `pools.light.instances[0].url`.

- `schema.py`: the structs, their SPEC defaults and value ranges;
- `load.py`: YAML (duplicate keys refused), `${VAR}` / `${VAR:-default}` expansion of values
  (never keys, one pass), small rewrites (empty section = defaults, `realtime`/`batch` =
  `high`/`low`, partial `scheduler.high`/`low` completed), then decoding and validation;
- `errors.py`: msgspec's messages → field paths and reasons, every failing field of them;
- `validate.py`: cross-field checks (names, URLs, references between pools, cycles, auth),
  run on whatever decoded;
- `json_schema.py`: the file's JSON Schema for editors (`gateway schema`);
- `secret.py`: fields typed `Secret` (instance `api_key`, header values, `proxy`, client
  `key`, `admin_key`) are plain strings that no error or `repr` ever shows.

`gateway check`'s routing table is `gateway.check.describe`.
"""

from __future__ import annotations

from gateway.config.load import expand_env, load_config, parse_config
from gateway.config.schema import (
    DEFAULT_COMPLEX_KEYWORDS,
    DEFAULT_SIMPLE_KEYWORDS,
    PRIORITIES,
    Affinity,
    ApiKey,
    Auth,
    BalancerName,
    Batch,
    Classifier,
    ClassSettings,
    Cluster,
    ComplexityName,
    ComplexityRouting,
    Config,
    Health,
    InstanceSpec,
    Limits,
    Listen,
    ModelAlias,
    PolicyName,
    PoolSpec,
    PriorityName,
    Probe,
    ProviderName,
    Retries,
    Routing,
    Scheduler,
    Shutdown,
    Telemetry,
    Timeouts,
    TlsSpec,
)
from gateway.config.secret import MASK, Secret, masked, secret_values

__all__ = [
    "DEFAULT_COMPLEX_KEYWORDS",
    "DEFAULT_SIMPLE_KEYWORDS",
    "MASK",
    "PRIORITIES",
    "Affinity",
    "ApiKey",
    "Auth",
    "BalancerName",
    "Batch",
    "ClassSettings",
    "Classifier",
    "Cluster",
    "ComplexityName",
    "ComplexityRouting",
    "Config",
    "Health",
    "InstanceSpec",
    "Limits",
    "Listen",
    "ModelAlias",
    "PolicyName",
    "PoolSpec",
    "PriorityName",
    "Probe",
    "ProviderName",
    "Retries",
    "Routing",
    "Scheduler",
    "Secret",
    "Shutdown",
    "Telemetry",
    "Timeouts",
    "TlsSpec",
    "expand_env",
    "load_config",
    "masked",
    "parse_config",
    "secret_values",
]
