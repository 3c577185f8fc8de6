//! Serde helpers the generated management types name in their attributes
//! (`spillctl --output json`).

use base64::Engine as _;

/// Bytes as standard base64, as proto3's JSON mapping writes them.
pub fn base64<S: serde::Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
}
