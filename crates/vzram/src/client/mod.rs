//! Client commands that talk to a running daemon over its control socket:
//! `vzram stat`, `set-limit`, `compact`, `add`, `remove`, `reset`,
//! `reset-max`, `mark-idle`, `recompress`, `writeback`. Requests are
//! [`control::Request`], the type the daemon parses.

use std::path::Path;

use serde_json::{json, Value};

use crate::cli::{
    AddArgs, Command, CompactArgs, DeviceArgs, MigrateArgs, RecompressArgs, SetLimitArgs, StatArgs,
    WritebackArgs,
};
use crate::proto::control::{self, DeviceRef, Request, MIGRATE_WAIT, TIER_WAIT};
use render::{human, render};

mod render;

/// An error for the user, and the exit code it deserves.
pub struct ClientError {
    pub message: String,
    pub code: u8,
}

/// Runs a client command; `serve` is not one.
pub fn run(cmd: Command) -> Result<String, ClientError> {
    match cmd {
        Command::Stat(a) => stat(&a),
        Command::SetLimit(a) => set_limit(&a),
        Command::Compact(a) => compact(&a),
        Command::Add(a) => add(&a),
        Command::Remove(a) => remove(&a),
        Command::Reset(a) => reset(&a),
        Command::ResetMax(a) => reset_max(&a),
        Command::MarkIdle(a) => mark_idle(&a),
        Command::Recompress(a) => recompress(&a),
        Command::Writeback(a) => writeback(&a),
        Command::Migrate(a) => migrate(&a),
        Command::Serve(_) => Err(ClientError {
            message: "serve is the daemon, not a client command".into(),
            code: 2,
        }),
    }
}

fn call(path: &Path, req: Request) -> Result<Value, ClientError> {
    call_waiting(path, req, control::CLIENT_TIMEOUT)
}

/// [`call`] for a request that may take up to `wait`.
fn call_waiting(
    path: &Path,
    req: Request,
    wait: std::time::Duration,
) -> Result<Value, ClientError> {
    let req = serde_json::to_value(&req).map_err(|e| ClientError {
        message: format!("cannot encode the request: {e}"),
        code: 1,
    })?;
    let reply = control::request_waiting(path, &req, wait).map_err(|e| ClientError {
        message: format!("cannot talk to the daemon at {}: {e}", path.display()),
        code: 1,
    })?;
    if reply["ok"] == json!(true) {
        Ok(reply)
    } else {
        let msg = reply["error"]
            .as_str()
            .unwrap_or("unknown error")
            .to_string();
        Err(ClientError {
            message: format!("daemon refused: {msg}"),
            code: 2,
        })
    }
}

pub fn stat(args: &StatArgs) -> Result<String, ClientError> {
    let reply = call(&args.control, Request::Stat {})?;
    if args.json {
        Ok(format!("{reply}\n"))
    } else {
        Ok(render(&reply))
    }
}

pub fn set_limit(args: &SetLimitArgs) -> Result<String, ClientError> {
    let req = match &args.device {
        Some(d) => Request::SetLimit {
            device: Some(DeviceRef::named(d)),
            host: false,
            bytes: args.size,
        },
        None => Request::SetLimit {
            device: None,
            host: true,
            bytes: args.size,
        },
    };
    call(&args.control, req)?;
    let what = args
        .device
        .as_ref()
        .map_or("host".to_string(), |d| format!("device {d}"));
    let limit = if args.size == 0 {
        "none".to_string()
    } else {
        human(args.size)
    };
    Ok(format!("{what} memory limit: {limit}\n"))
}

pub fn add(args: &AddArgs) -> Result<String, ClientError> {
    let reply = call(
        &args.control,
        Request::Add {
            device: args.device.clone(),
        },
    )?;
    Ok(format!(
        "added device {} (index {})\n",
        reply["device"].as_str().unwrap_or("?"),
        reply["index"]
    ))
}

pub fn remove(args: &DeviceArgs) -> Result<String, ClientError> {
    call(
        &args.control,
        Request::Remove {
            device: DeviceRef::named(&args.device),
        },
    )?;
    Ok(format!("removed device {} and its state\n", args.device))
}

pub fn reset(args: &DeviceArgs) -> Result<String, ClientError> {
    let reply = call(
        &args.control,
        Request::Reset {
            device: DeviceRef::named(&args.device),
        },
    )?;
    Ok(format!(
        "reset device {}: {} pages dropped\n",
        args.device,
        reply["pages_dropped"].as_u64().unwrap_or(0)
    ))
}

pub fn reset_max(args: &CompactArgs) -> Result<String, ClientError> {
    let req = Request::ResetMax {
        device: args.device.as_deref().map(DeviceRef::named),
    };
    call(&args.control, req)?;
    Ok("mem_used_max reset\n".to_string())
}

pub fn compact(args: &CompactArgs) -> Result<String, ClientError> {
    let req = Request::Compact {
        device: args.device.as_deref().map(DeviceRef::named),
    };
    let reply = call(&args.control, req)?;
    let pages = reply["pages_compacted"].as_u64().unwrap_or(0);
    Ok(format!(
        "compacted: {pages} pages ({}) given back\n",
        human(pages * 4096)
    ))
}

/// How long the tiering commands wait for the daemon: as long as the
/// daemon lets an order run, and a little more for the reply.
/// How long a tiering command waits: the daemon's own limit and a margin.
const TIER_CLIENT_WAIT: std::time::Duration =
    TIER_WAIT.saturating_add(std::time::Duration::from_secs(10));

pub fn mark_idle(args: &DeviceArgs) -> Result<String, ClientError> {
    let req = Request::MarkIdle {
        device: DeviceRef::named(&args.device),
    };
    let reply = call_waiting(&args.control, req, TIER_CLIENT_WAIT)?;
    Ok(format!(
        "device {}: {} pages marked idle\n",
        args.device,
        reply["pages_marked"].as_u64().unwrap_or(0)
    ))
}

pub fn recompress(args: &RecompressArgs) -> Result<String, ClientError> {
    let req = Request::Recompress {
        device: DeviceRef::named(&args.target.device),
        idle: args.idle,
        huge: args.huge,
        algo: args.algo.map(|a| a.to_string()),
    };
    let r = call_waiting(&args.target.control, req, TIER_CLIENT_WAIT)?;
    let n = |k: &str| r[k].as_u64().unwrap_or(0);
    Ok(format!(
        "device {}: recompressed {} of {} pages tried with {}, {} smaller; {} of memory given back\n",
        args.target.device,
        n("pages_recompressed"),
        n("pages_tried"),
        r["algo"].as_str().unwrap_or("?"),
        human(n("saved_bytes")),
        human(n("freed_bytes")),
    ))
}

pub fn writeback(args: &WritebackArgs) -> Result<String, ClientError> {
    let req = Request::Writeback {
        device: DeviceRef::named(&args.target.device),
        idle: args.idle,
        cold: args.cold,
        huge: args.huge,
        incompressible: args.incompressible,
        max_pages: args.max_pages,
    };
    let r = call_waiting(&args.target.control, req, TIER_CLIENT_WAIT)?;
    let pages = r["pages_written"].as_u64().unwrap_or(0);
    Ok(format!(
        "device {}: wrote {pages} pages ({}) to the backing file; {} of memory given back\n",
        args.target.device,
        human(pages * 4096),
        human(r["freed_bytes"].as_u64().unwrap_or(0)),
    ))
}

pub fn migrate(args: &MigrateArgs) -> Result<String, ClientError> {
    let req = Request::Migrate {
        device: DeviceRef::named(&args.target.device),
        to: args.to.to_string(),
        keep: args.keep,
    };
    let wait = MIGRATE_WAIT.saturating_add(std::time::Duration::from_secs(10));
    let r = call_waiting(&args.target.control, req, wait)?;
    let n = |k: &str| r[k].as_u64().unwrap_or(0);
    let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
    Ok(format!(
        "device {}: migrated to {}: {} pages, {} in {} passes, {:.1} s ({:.1} MiB/s); last delta {} pages in {:.1} ms; {}\n",
        args.target.device,
        args.to,
        n("pages"),
        human(n("bytes")),
        n("passes"),
        f("seconds"),
        f("rate_mib_s"),
        n("final_records"),
        f("final_ms"),
        if args.keep { "pages kept here" } else { "pages dropped here" },
    ))
}
