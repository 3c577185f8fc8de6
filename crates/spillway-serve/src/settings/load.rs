//! Loading: each layer (the file, then each variable) read on its own
//! for unknown keys, names set twice and bad values; then merged, and the
//! result checked for values out of range (`check.rs`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::env::{config_vars, env_source, ENV_PREFIX};
use super::error::{Origin, Problem, SettingsError};
use super::{aliases, keys, Settings};

/// One layer, built (sections as tables) and its aliases moved to their own
/// names.
fn canonical_layer(
    source: impl config::Source + Send + Sync + 'static,
    origin: &Origin,
) -> Result<aliases::Canonical, SettingsError> {
    let read_error = |error| SettingsError::Read {
        origin: origin.clone(),
        error: Box::new(error),
    };
    let layer = config::Config::builder()
        .add_source(source)
        .build()
        .map_err(read_error)?;
    Ok(aliases::canonical(
        config::Source::collect(&layer).map_err(read_error)?,
    ))
}

/// Reads one layer on its own, its aliases moved to their own names
/// ([`aliases`]): a [`Problem`] for each key in it no setting reads, for a
/// key it sets under two names, and for a value that does not deserialise.
/// The unknown keys come back as the layer wrote them.
fn check_layer(
    source: impl config::Source + Send + Sync + 'static,
    origin: &Origin,
    problems: &mut Vec<Problem>,
) -> Result<(aliases::Canonical, Vec<String>), SettingsError> {
    let layer = canonical_layer(source, origin)?;
    for twice in &layer.twice {
        problems.push(Problem::SetTwice {
            alias: twice.alias.clone(),
            name: twice.name.clone(),
            origin: origin.clone(),
        });
    }
    let mut ignored = Vec::new();
    let read: Result<Settings, _> = serde_ignored::deserialize(layer.value(), |path| {
        ignored.push(keys::render(&keys::segments(&path)))
    });
    if let Err(error) = read {
        problems.push(Problem::BadValue {
            origin: origin.clone(),
            error: error.to_string(),
        });
    }
    let ignored = ignored.iter().map(|key| layer.as_written(key)).collect();
    Ok((layer, ignored))
}

/// `key` (as written, aliases included) as an unknown key of `origin`, with
/// the nearest known key written the same way.
fn unknown_key(key: &str, origin: &Origin) -> Problem {
    let (name, alias) = aliases::resolve(key);
    let suggestion = keys::suggest::<Settings>(&keys::parse(&name)).map(|known| {
        let known = keys::render(&known);
        match alias {
            Some((alias, name)) => aliases::written_as(&known, name, alias),
            None => known,
        }
    });
    Problem::UnknownKey {
        key: key.to_string(),
        origin: origin.clone(),
        suggestion,
    }
}

impl Settings {
    /// Defaults ← the file (when given, or `spillway.toml` when present) ←
    /// `SPILLWAY_<SECTION>__<KEY>` environment variables; refused with every
    /// unknown key and out-of-range value named.
    pub fn load(file: Option<&Path>) -> Result<Self, SettingsError> {
        Self::load_with_env(file, std::env::vars_os())
    }

    /// [`Settings::load`] with these environment variables instead of the
    /// process's.
    pub fn load_with_env(
        file: Option<&Path>,
        vars: impl IntoIterator<Item = (OsString, OsString)>,
    ) -> Result<Self, SettingsError> {
        let mut problems = Vec::new();
        let (file_path, file_source) = match file {
            Some(path) => (
                path.to_path_buf(),
                config::File::from(path)
                    .format(config::FileFormat::Toml)
                    .required(true),
            ),
            None => {
                let path = PathBuf::from("spillway.toml");
                let source = config::File::from(path.as_path())
                    .format(config::FileFormat::Toml)
                    .required(false);
                (path, source)
            }
        };
        let file_origin = Origin::File(file_path);
        let (file_layer, mut ignored) = check_layer(file_source, &file_origin, &mut problems)?;
        // The `config` crate keeps keys in a hash map: sorted, the report
        // does not change from one start to the next.
        ignored.sort();
        for key in &ignored {
            problems.push(unknown_key(key, &file_origin));
        }

        let vars = config_vars(vars);
        for var in &vars {
            let origin = Origin::Env(var.name.clone());
            if var.value.to_str().is_none() {
                problems.push(Problem::BadValue {
                    origin,
                    error: "the value is not valid Unicode".into(),
                });
                continue;
            }
            let (_, ignored) = check_layer(env_source([var]), &origin, &mut problems)?;
            if !ignored.is_empty() {
                // The variable's own key, not the ignored part of it: for
                // `SPILLWAY_GATWAY__HEARTBEAT` that is `gatway.heartbeat`,
                // whose nearest known key is `gateway.heartbeat`.
                problems.push(unknown_key(&var.key, &origin));
            }
        }
        // Two variables naming one key under its two names.
        let env_layer = canonical_layer(env_source(&vars), &Origin::Env(ENV_PREFIX.into()))?;
        for twice in &env_layer.twice {
            problems.push(Problem::SetTwice {
                alias: twice.alias.clone(),
                name: twice.name.clone(),
                origin: Origin::Env(ENV_PREFIX.into()),
            });
        }
        if !problems.is_empty() {
            return Err(SettingsError::Invalid(problems));
        }

        let file_layer = config::Config::builder()
            .add_source(file_layer)
            .build()
            .map_err(|error| SettingsError::Merge(Box::new(error)))?;
        let settings: Settings = config::Config::builder()
            .add_source(file_layer.clone())
            .add_source(env_layer)
            .build()
            .and_then(config::Config::try_deserialize)
            .map_err(|error| SettingsError::Merge(Box::new(error)))?;
        let origin_of = |key: &str| {
            vars.iter()
                .rev()
                .find(|var| aliases::resolve(&var.key).0 == key)
                .map(|var| Origin::Env(var.name.clone()))
                .or_else(|| {
                    file_layer
                        .get::<config::Value>(key)
                        .is_ok()
                        .then(|| file_origin.clone())
                })
        };
        let mut settings = settings;
        let mut ranges = settings.out_of_range();
        ranges.extend(settings.cluster.resolve());
        let problems: Vec<_> = ranges
            .into_iter()
            .map(|range| Problem::OutOfRange {
                origin: origin_of(&range.key),
                key: range.key,
                value: range.value,
                allowed: range.allowed,
            })
            .collect();
        if !problems.is_empty() {
            return Err(SettingsError::Invalid(problems));
        }
        Ok(settings)
    }
}
