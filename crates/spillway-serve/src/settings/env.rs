//! The environment layer: `SPILLWAY_<SECTION>__<KEY>` variables, and a
//! key's name as such a variable.

use std::ffi::OsString;

/// The name every configuration environment variable starts with (case
/// does not matter, as for the rest of the name).
pub(super) const ENV_PREFIX: &str = "SPILLWAY_";
/// Between section and key in a configuration environment variable; a
/// `SPILLWAY_` variable without it is some other program's (`SPILLWAY_BIN`).
const ENV_SEPARATOR: &str = "__";

/// `gateway.heartbeat` → `SPILLWAY_GATEWAY__HEARTBEAT`.
pub(super) fn env_name(key: &str) -> String {
    format!(
        "{ENV_PREFIX}{}",
        key.split('.')
            .map(str::to_ascii_uppercase)
            .collect::<Vec<_>>()
            .join(ENV_SEPARATOR)
    )
}

/// A configuration environment variable: its name as set, its key
/// (`gateway.heartbeat`) and its value.
pub(super) struct EnvVar {
    pub(super) name: String,
    pub(super) key: String,
    pub(super) value: OsString,
}

/// The `SPILLWAY_<SECTION>__<KEY>` variables among `vars`; any other
/// (`SPILLWAY_BIN`, `SPILLWAY_REGENERATE_PROTO`, `PATH`) is not configuration.
pub(super) fn config_vars(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Vec<EnvVar> {
    vars.into_iter()
        .filter_map(|(name, value)| {
            let name = name.into_string().ok()?;
            let prefix = name.get(..ENV_PREFIX.len())?;
            let rest = name.get(ENV_PREFIX.len()..)?;
            if !prefix.eq_ignore_ascii_case(ENV_PREFIX) || !rest.contains(ENV_SEPARATOR) {
                return None;
            }
            let key = rest.to_lowercase().replace(ENV_SEPARATOR, ".");
            Some(EnvVar { name, key, value })
        })
        .collect()
}

/// The `config` source for `vars`, read the way the documentation says.
pub(super) fn env_source<'a>(vars: impl IntoIterator<Item = &'a EnvVar>) -> config::Environment {
    let mut map = config::Map::new();
    for var in vars {
        // Lossy only for a value already reported as not Unicode.
        map.insert(var.name.clone(), var.value.to_string_lossy().into_owned());
    }
    config::Environment::with_prefix("SPILLWAY")
        .prefix_separator("_")
        .separator(ENV_SEPARATOR)
        .try_parsing(true)
        .source(Some(map))
}
