//! Who is listening on a loopback port: before a secret or a prompt goes to `127.0.0.1:<port>`,
//! or a health answer from there is trusted, the listening socket must belong to the expected
//! uid. Any local user can bind a free loopback port (when the bridge or a vLLM server is down,
//! say) and would otherwise receive the bridge token and the agent's prompts, or vouch for a
//! backend's health.
//!
//! The owner comes from the kernel's socket tables, `/proc/net/tcp` and `/proc/net/tcp6` (the
//! `uid` column of the `LISTEN` rows), as seen from this process's network namespace. Every
//! listener that could accept a connection to the address counts (the exact address, the
//! wildcard, a dual-stack `::`), and all of them must be the expected uid.
//!
//! What remains: the check and the connect are two steps, so a listener that is swapped in
//! between (the owner's process exits and another user binds the port within that instant, or
//! within a [`LoopbackGuard`]'s cache lifetime) is not caught. The owner's own listener holds
//! the port while it runs, so the window needs the owner to die at that moment.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Why a loopback destination is not trusted.
#[derive(Debug, thiserror::Error)]
pub enum LoopbackError {
    /// Nothing listens on the address (nothing to trust; a connect would fail anyway).
    #[error("nothing listens on {addr}")]
    NoListener {
        /// The address.
        addr: SocketAddr,
    },
    /// A listener on the address belongs to another uid.
    #[error("the listener on {addr} belongs to uid {found}, not uid {expected}")]
    WrongOwner {
        /// The address.
        addr: SocketAddr,
        /// Its owner.
        found: u32,
        /// Who should own it.
        expected: u32,
    },
    /// The socket tables could not be read.
    #[error("cannot read the socket tables: {0}")]
    Tables(String),
}

/// The uids of every TCP socket listening where a connection to `addr` could land.
///
/// # Errors
/// When neither socket table can be read.
pub fn listener_owners(addr: SocketAddr) -> Result<Vec<u32>, LoopbackError> {
    let mut owners = Vec::new();
    let mut read_any = false;
    let mut last_err = String::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        match std::fs::read_to_string(table) {
            Ok(text) => {
                read_any = true;
                owners.extend(owners_in(&text, addr));
            }
            // tcp6 is absent when IPv6 is disabled.
            Err(e) => last_err = format!("{table}: {e}"),
        }
    }
    if read_any {
        Ok(owners)
    } else {
        Err(LoopbackError::Tables(last_err))
    }
}

/// Checks that something listens on `addr` and that every listener there is `expected`'s.
///
/// # Errors
/// [`LoopbackError`] saying why not.
pub fn check_owner(addr: SocketAddr, expected: u32) -> Result<(), LoopbackError> {
    let owners = listener_owners(addr)?;
    if owners.is_empty() {
        return Err(LoopbackError::NoListener { addr });
    }
    match owners.into_iter().find(|uid| *uid != expected) {
        Some(found) => Err(LoopbackError::WrongOwner {
            addr,
            found,
            expected,
        }),
        None => Ok(()),
    }
}

/// The LISTEN rows of one table (`/proc/net/tcp` or `tcp6` text) that can accept `addr`.
fn owners_in(text: &str, addr: SocketAddr) -> Vec<u32> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
            let (local, state, uid) = (cols.get(1)?, cols.get(3)?, cols.get(7)?);
            if *state != "0A" {
                return None;
            }
            let (ip, port) = local.split_once(':')?;
            let port = u16::from_str_radix(port, 16).ok()?;
            let ip = parse_ip(ip)?;
            (port == addr.port() && accepts(ip, addr.ip()))
                .then(|| uid.parse().ok())
                .flatten()
        })
        .collect()
}

/// The kernel prints addresses as 32-bit words in host byte order.
fn parse_ip(hex: &str) -> Option<IpAddr> {
    let word = |s: &str| u32::from_str_radix(s, 16).ok().map(u32::to_ne_bytes);
    match hex.len() {
        8 => Some(IpAddr::V4(Ipv4Addr::from(word(hex)?))),
        32 => {
            let mut b = [0u8; 16];
            for (i, chunk) in b.chunks_mut(4).enumerate() {
                chunk.copy_from_slice(&word(hex.get(i * 8..i * 8 + 8)?)?);
            }
            Some(IpAddr::V6(Ipv6Addr::from(b)))
        }
        _ => None,
    }
}

/// Whether a socket bound to `bound` receives connections to `target`.
fn accepts(bound: IpAddr, target: IpAddr) -> bool {
    if bound == target || bound.is_unspecified() {
        return true;
    }
    match (bound, target) {
        (IpAddr::V6(b), IpAddr::V4(t)) => b.to_ipv4_mapped() == Some(t),
        (IpAddr::V4(b), IpAddr::V6(t)) => t.to_ipv4_mapped() == Some(b),
        (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_)) => false,
    }
}

/// The loopback addresses a URL's host names: an IP literal on loopback, or `localhost` (both
/// families). `None` for any other host, which this module does not vouch for.
pub fn loopback_addrs(url: &url::Url) -> Option<Vec<SocketAddr>> {
    let port = url.port_or_known_default()?;
    let ips = match url.host()? {
        url::Host::Ipv4(ip) if ip.is_loopback() => vec![IpAddr::V4(ip)],
        url::Host::Ipv6(ip) if ip.is_loopback() => vec![IpAddr::V6(ip)],
        url::Host::Domain(d) if d.eq_ignore_ascii_case("localhost") => {
            vec![Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()]
        }
        url::Host::Ipv4(_) | url::Host::Ipv6(_) | url::Host::Domain(_) => return None,
    };
    Some(
        ips.into_iter()
            .map(|ip| SocketAddr::new(ip, port))
            .collect(),
    )
}

/// How long a passed check is remembered per address.
pub const OWNER_CACHE_TTL: Duration = Duration::from_secs(1);

/// Checks loopback destinations against one expected owner, remembering passes for
/// [`OWNER_CACHE_TTL`] so a busy proxy does not read the socket tables per request.
#[derive(Debug)]
pub struct LoopbackGuard {
    expected: u32,
    passed: Mutex<HashMap<SocketAddr, Instant>>,
}

impl LoopbackGuard {
    /// Loopback listeners must belong to `expected`.
    pub fn new(expected: u32) -> Self {
        LoopbackGuard {
            expected,
            passed: Mutex::new(HashMap::new()),
        }
    }

    /// The uid listeners must belong to.
    pub fn expected(&self) -> u32 {
        self.expected
    }

    /// Checks `url` if its host is on loopback; other hosts pass. The URL comes parsed: a
    /// daemon parses its configured endpoints once, at start.
    ///
    /// # Errors
    /// [`LoopbackError`] when a loopback listener there is not the expected uid's.
    pub fn check_url(&self, parsed: &url::Url) -> Result<(), LoopbackError> {
        let Some(addrs) = loopback_addrs(parsed) else {
            return Ok(());
        };
        for addr in addrs {
            self.check(addr)?;
        }
        Ok(())
    }

    /// [`check_owner`] with the cache.
    ///
    /// # Errors
    /// As [`check_owner`].
    pub fn check(&self, addr: SocketAddr) -> Result<(), LoopbackError> {
        let fresh = |t: &Instant| t.elapsed() < OWNER_CACHE_TTL;
        if self.lock().get(&addr).is_some_and(fresh) {
            return Ok(());
        }
        // No pass for a family nobody listens on: the client may connect to whichever a local
        // user binds just after the check (the config refuses `localhost` where it is checked).
        match check_owner(addr, self.expected) {
            Ok(()) => {
                self.lock().insert(addr, Instant::now());
                Ok(())
            }
            Err(e) => {
                self.lock().remove(&addr);
                Err(e)
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Instant>> {
        self.passed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:2256 00000000:0000 0A 00000000:00000000 00:00000000 00000000   999        0 1 1
   1: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000    65534        0 2 1
   2: 0100007F:2256 0100007F:C000 01 00000000:00000000 00:00000000 00000000  1234        0 3 1
";
    const TABLE6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:0BB8 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     7        0 4 1
   1: 00000000000000000000000000000000:0FA0 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     8        0 5 1
";

    #[test]
    fn listen_rows_for_the_address_and_wildcards() {
        let v4 = |p| SocketAddr::from((Ipv4Addr::LOCALHOST, p));
        assert_eq!(
            owners_in(TABLE, v4(0x2256)),
            vec![999],
            "established rows skipped"
        );
        assert_eq!(owners_in(TABLE, v4(0x1F90)), vec![65534], "0.0.0.0 counts");
        assert!(owners_in(TABLE, v4(1)).is_empty());
        assert_eq!(owners_in(TABLE6, v4(0x0FA0)), vec![8], ":: takes IPv4 too");
        let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, 0x0BB8));
        assert_eq!(owners_in(TABLE6, v6), vec![7]);
        assert!(
            owners_in(TABLE6, v4(0x0BB8)).is_empty(),
            "::1 takes no IPv4"
        );
    }

    #[test]
    fn only_loopback_urls_are_checked() {
        let u = |s: &str| url::Url::parse(s).unwrap();
        assert_eq!(
            loopback_addrs(&u("http://127.0.0.1:8790/v1")).unwrap(),
            vec![SocketAddr::from((Ipv4Addr::LOCALHOST, 8790))]
        );
        assert_eq!(loopback_addrs(&u("http://localhost/")).unwrap().len(), 2);
        assert!(loopback_addrs(&u("https://api.example.com/v1")).is_none());
        assert!(loopback_addrs(&u("http://10.0.0.1:80/")).is_none());
    }

    #[test]
    fn a_real_listener_is_ours() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let me = rustix::process::geteuid().as_raw();
        check_owner(addr, me).unwrap();
        assert!(matches!(
            check_owner(addr, me + 1),
            Err(LoopbackError::WrongOwner { found, .. }) if found == me
        ));
        drop(l);
        assert!(matches!(
            check_owner(addr, me),
            Err(LoopbackError::NoListener { .. })
        ));
    }
}
