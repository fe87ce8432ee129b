//! `/metrics` as a scraper sees it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// The whole HTTP reply to `GET /metrics` at `addr`.
pub fn scrape(addr: SocketAddr) -> String {
    let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    out
}

/// The value of `series` (with its labels, exactly as written) in a
/// scrape; a series that is not there fails the test.
pub fn metric(body: &str, series: &str) -> u64 {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in\n{body}"))
        .parse()
        .unwrap()
}
