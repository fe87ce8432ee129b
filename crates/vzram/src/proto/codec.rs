//! A [`Codec`] on the wire: as the text the command line takes
//! (`lz4`, `zstd:3`), so a spec in `ps` reads as the configuration did.

use serde::{Deserialize, Deserializer, Serializer};
use vzram_store::Codec;

pub fn serialize<S: Serializer>(c: &Codec, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(c)
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Codec, D::Error> {
    let text = String::deserialize(d)?;
    text.parse().map_err(serde::de::Error::custom)
}

/// An optional [`Codec`], as its text or absent.
pub mod optional {
    use super::*;

    pub fn serialize<S: Serializer>(c: &Option<Codec>, s: S) -> Result<S::Ok, S::Error> {
        match c {
            Some(c) => s.collect_str(c),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Codec>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|t| t.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}
