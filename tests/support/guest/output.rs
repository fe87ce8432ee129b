//! What a guest printed, and the `k=v` fields of its result lines.

use std::collections::BTreeMap;
use std::process::ExitStatus;

/// What a guest printed. Fields of a result line are parsed by [`Self::fields`].
#[derive(Clone, Debug)]
pub struct GuestOutput {
    pub label: String,
    pub lines: Vec<String>,
    pub status: Option<ExitStatus>,
    pub secs: f64,
}

/// Prefixes of the guest's own result lines.
const RESULT_PREFIXES: &[&str] = &[
    "GUEST ", "DISK ", "PRESSURE", "SWAP", "FS ", "TRIM ", "RAW ", "DISCARD ", "HOLD ", "VZRAM-",
];

impl GuestOutput {
    pub(super) fn print_summary(&self) {
        eprintln!(
            "  guest {} ran {:.1}s, qemu {:?}",
            self.label, self.secs, self.status
        );
        for l in &self.lines {
            if RESULT_PREFIXES.iter().any(|p| l.starts_with(p)) || l.starts_with("qemu-stderr") {
                let l: String = l.chars().take(200).collect();
                eprintln!("  | {l}");
            }
        }
    }

    /// The first line that starts with `prefix` (our lines always start a
    /// line; kernel lines never look like them).
    pub fn line(&self, prefix: &str) -> Option<&str> {
        self.lines
            .iter()
            .map(String::as_str)
            .find(|l| l.starts_with(prefix))
    }

    /// The `k=v` fields of the first line starting with `prefix`; panics
    /// when there is none.
    pub fn fields(&self, prefix: &str) -> Fields {
        let l = self
            .line(prefix)
            .unwrap_or_else(|| panic!("guest {}: no line starting with {prefix:?}", self.label));
        let map = l
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Fields {
            line: l.to_string(),
            map,
        }
    }

    /// The rc of `VZRAM-GUEST-DONE rc=N`, if the guest got that far.
    pub fn done_rc(&self) -> Option<i64> {
        self.line("VZRAM-GUEST-DONE ")
            .map(|_| self.fields("VZRAM-GUEST-DONE ").num("rc"))
    }

    /// The guest finished every scenario successfully and QEMU exited 0.
    pub fn expect_ok(&self) -> &Self {
        ensure!(
            self.done_rc() == Some(0),
            "guest {}: wanted VZRAM-GUEST-DONE rc=0, got {:?}; failures: {:?}",
            self.label,
            self.line("VZRAM-GUEST-DONE"),
            self.lines
                .iter()
                .filter(|l| l.starts_with("VZRAM-GUEST-FAIL"))
                .collect::<Vec<_>>()
        );
        ensure!(
            self.status.is_some_and(|s| s.success()),
            "guest {}: QEMU exited with {:?}",
            self.label,
            self.status
        );
        self
    }
}

/// The `k=v` fields of one guest line.
#[derive(Clone, Debug)]
pub struct Fields {
    pub line: String,
    pub map: BTreeMap<String, String>,
}

impl Fields {
    pub fn str(&self, k: &str) -> &str {
        self.map
            .get(k)
            .unwrap_or_else(|| panic!("no {k}= in guest line {:?}", self.line))
    }

    pub fn num(&self, k: &str) -> i64 {
        let v = self.str(k);
        v.parse()
            .unwrap_or_else(|_| panic!("{k}={v} is not an integer in guest line {:?}", self.line))
    }

    pub fn float(&self, k: &str) -> f64 {
        let v = self.str(k);
        v.parse()
            .unwrap_or_else(|_| panic!("{k}={v} is not a number in guest line {:?}", self.line))
    }
}
