//! The generated gRPC code is checked in (no protoc needed to build). This test
//! regenerates it from `proto/` and fails when the checked-in copy differs.
//! Run with `SPILLWAY_REGENERATE_PROTO=1` to rewrite the checked-in copy.
//!
//! Besides the Rust code it writes `management_descriptor.bin`: the encoded
//! file descriptor set of the public management API, which the management
//! service serves through gRPC server reflection.

use std::path::{Path, PathBuf};

/// The engine's services: a gateway session is a stream each way, kept for
/// as long as its client connection.
const ENGINE_PROTOS: &[&str] = &[
    "spillway/engine/v1/engine.proto",
    "spillway/engine/v1/admin.proto",
    "spillway/management/v1/management.proto",
];

fn generate_into(out_dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files: Vec<PathBuf> = ENGINE_PROTOS.iter().map(|p| proto_root.join(p)).collect();
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .bytes(".")
        // Small starting stream buffers (`util/lean_codec.rs`), paid per client
        // connection in the separate wiring.
        .codec_path("crate::util::lean_codec::LeanCodec")
        // The engine's admin API carries the public API's messages.
        .extern_path(".spillway.management.v1", "crate::management")
        .out_dir(out_dir)
        .compile_protos(&files, std::slice::from_ref(&proto_root))?;
    // The storage node's service: a few streams per engine, carrying the
    // store's write batches; tonic's default buffers.
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .bytes(".")
        .out_dir(out_dir)
        .compile_protos(
            &[proto_root.join("spillway/storage/v1/storage.proto")],
            std::slice::from_ref(&proto_root),
        )?;
    // The public API again, alone: its Rust code with `--output json`
    // support for spillctl, and its descriptor set for reflection.
    let management = tempfile::tempdir()?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .bytes(".")
        .type_attribute(".spillway.management.v1", "#[derive(serde::Serialize)]")
        .message_attribute(
            ".spillway.management.v1.ArgumentValue",
            "#[serde(transparent)]",
        )
        .type_attribute(
            ".spillway.management.v1.ArgumentValue.value",
            "#[serde(untagged)]",
        )
        .field_attribute(
            ".spillway.management.v1.PeekedMessage.body",
            "#[serde(serialize_with = \"crate::util::json::base64\")]",
        )
        .field_attribute(
            ".spillway.management.v1.PublishMessageRequest.body",
            "#[serde(serialize_with = \"crate::util::json::base64\")]",
        )
        .field_attribute(
            ".spillway.management.v1.DefinedUser.password_hash",
            "#[serde(serialize_with = \"crate::util::json::base64\")]",
        )
        .file_descriptor_set_path(out_dir.join(DESCRIPTOR))
        .out_dir(management.path())
        .compile_protos(
            &[proto_root.join("spillway/management/v1/management.proto")],
            &[proto_root],
        )?;
    std::fs::copy(
        management.path().join("spillway.management.v1.rs"),
        out_dir.join("spillway.management.v1.rs"),
    )?;
    Ok(())
}

const DESCRIPTOR: &str = "management_descriptor.bin";

#[test]
fn generated_code_is_fresh() -> Result<(), Box<dyn std::error::Error>> {
    let checked_in = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/generated");
    if std::env::var_os("SPILLWAY_REGENERATE_PROTO").is_some() {
        generate_into(&checked_in)?;
        return Ok(());
    }
    let fresh = tempfile::tempdir()?;
    generate_into(fresh.path())?;
    let mut names: Vec<_> = std::fs::read_dir(fresh.path())?
        .map(|entry| entry.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    names.sort();
    for name in names {
        let want = std::fs::read(fresh.path().join(&name))?;
        let have = std::fs::read(checked_in.join(&name)).unwrap_or_default();
        assert!(
            want == have,
            "{} is stale: run `SPILLWAY_REGENERATE_PROTO=1 cargo test --release -p spillway-proto`",
            name.to_string_lossy()
        );
    }
    Ok(())
}
