//! Field readers that take a value written as text (`--device` specs) or
//! as TOML wrote it (a number, a boolean).

use std::time::Duration;

use serde::{Deserialize, Deserializer};
use vzram_store::Codec;

use super::parse::{parse_bool, parse_codec, parse_duration, parse_size};
use crate::proto::addr::Addr;

#[derive(Deserialize)]
#[serde(untagged)]
enum Raw {
    Int(u64),
    Bool(bool),
    Text(String),
}

fn raw<'de, D: Deserializer<'de>>(d: D) -> Result<Raw, D::Error> {
    Raw::deserialize(d)
}

pub fn size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match raw(d)? {
        Raw::Int(n) => Ok(Some(n)),
        Raw::Text(t) => parse_size(&t).map(Some).map_err(serde::de::Error::custom),
        Raw::Bool(_) => Err(serde::de::Error::custom("a size, not a boolean")),
    }
}

pub fn number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u16>, D::Error> {
    let n = match raw(d)? {
        Raw::Int(n) => n,
        Raw::Text(t) => t
            .parse()
            .map_err(|_| serde::de::Error::custom(format!("bad number {t:?}")))?,
        Raw::Bool(_) => return Err(serde::de::Error::custom("a number, not a boolean")),
    };
    u16::try_from(n)
        .map(Some)
        .map_err(|_| serde::de::Error::custom(format!("{n} is too large")))
}

pub fn codec<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Codec>, D::Error> {
    match raw(d)? {
        Raw::Text(t) => parse_codec(&t).map(Some).map_err(serde::de::Error::custom),
        _ => Err(serde::de::Error::custom(
            "a codec name: lz4, zstd or zstd:LEVEL",
        )),
    }
}

pub fn boolean<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    match raw(d)? {
        Raw::Bool(b) => Ok(Some(b)),
        Raw::Text(t) => parse_bool(&t).map(Some).map_err(serde::de::Error::custom),
        Raw::Int(_) => Err(serde::de::Error::custom("true or false")),
    }
}

pub fn addr<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Addr>, D::Error> {
    match raw(d)? {
        Raw::Text(t) => t
            .parse::<Addr>()
            .map(Some)
            .map_err(serde::de::Error::custom),
        _ => Err(serde::de::Error::custom(
            "an address: unix:PATH or tcp:HOST:PORT",
        )),
    }
}

pub fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    match raw(d)? {
        Raw::Text(t) => parse_duration(&t)
            .map(Some)
            .map_err(serde::de::Error::custom),
        _ => Err(serde::de::Error::custom(
            "a duration with its unit, such as \"10m\"",
        )),
    }
}
