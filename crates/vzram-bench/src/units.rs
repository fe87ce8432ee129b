//! Sizes and counts as people write and read them: "4K", "1G", "1.2k".

/// "4K", "4k", "1G", "512MiB", "4096" -> bytes (binary multiples).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let body = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (num, shift) = match body.chars().last() {
        Some('k') => (&body[..body.len() - 1], 10),
        Some('m') => (&body[..body.len() - 1], 20),
        Some('g') => (&body[..body.len() - 1], 30),
        Some('t') => (&body[..body.len() - 1], 40),
        _ => (body, 0),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("bad size {s:?} (examples: 4K, 512M, 1G)"))?;
    n.checked_mul(1 << shift)
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("size {s:?} out of range"))
}

/// Shortest exact form: 4096 -> "4K", 1 GiB -> "1G", 1000 -> "1000".
pub fn format_size(n: u64) -> String {
    for (shift, suffix) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if n >= 1 << shift && n.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", n >> shift);
        }
    }
    n.to_string()
}

/// 1234567 -> "1.23M", 12345 -> "12.3k", 123 -> "123".
pub fn kilo(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("8192").unwrap(), 8192);
        assert!(parse_size("4X").is_err());
        assert!(parse_size("0").is_err());
        assert_eq!(format_size(4096), "4K");
        assert_eq!(format_size(3 << 30), "3G");
        assert_eq!(format_size(1536 << 10), "1536K");
        assert_eq!(format_size(1000), "1000");
    }

    #[test]
    fn counts() {
        assert_eq!(kilo(228_400.0), "228.4k");
        assert_eq!(kilo(950.0), "950");
    }
}
