//! Who is at the other end of an HTTP connection, so that one client's
//! connections cannot crowd out everyone else's.
//!
//! A remote client is its IP address. On loopback every local user shares
//! `127.0.0.1`, so there the peer is the user that owns the client's
//! socket: the kernel lists every TCP socket with its owner in
//! `/proc/net/tcp` (`tcp6`), and the client's socket is the one whose
//! local address is our peer address and whose remote address is ours —
//! what `identd` reads. The parser is pure and tested with inline tables.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

/// One client, for per-client connection limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Peer {
    /// A local user (loopback connection whose socket owner was found).
    Uid(u32),
    /// Any other client, or a local one whose owner could not be read.
    Ip(IpAddr),
}

/// An IPv4-mapped IPv6 address as IPv4 (a dual-stack listener sees IPv4
/// clients that way); anything else unchanged.
fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => addr,
        },
        v4 => v4,
    }
}

/// `ADDR:PORT` as `/proc/net/tcp{,6}` prints it: the address as native
/// 32-bit words in hex (`0100007F` is 127.0.0.1 on a little-endian
/// machine), the port in hex.
fn parse_proc_addr(text: &str) -> Option<SocketAddr> {
    let (addr, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        let hex = addr.get(i * 8..i * 8 + 8)?;
        Some(u32::from_str_radix(hex, 16).ok()?.to_ne_bytes())
    };
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for i in 0..4 {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(canonical(SocketAddr::new(ip, port)))
}

/// Every socket of a `/proc/net/tcp{,6}` table: (local, remote, owner).
/// Lines that do not parse are skipped.
fn sockets(table: &str) -> impl Iterator<Item = (SocketAddr, SocketAddr, u32)> + '_ {
    table.lines().skip(1).filter_map(|line| {
        let mut fields = line.split_ascii_whitespace();
        let local = parse_proc_addr(fields.nth(1)?)?;
        let remote = parse_proc_addr(fields.next()?)?;
        let uid = fields.nth(4)?.parse().ok()?;
        Some((local, remote, uid))
    })
}

/// The owner of the socket whose local address is `client` and remote
/// address is `server`, from a `/proc/net/tcp{,6}` table.
#[cfg(test)]
pub(crate) fn owner_in(table: &str, client: SocketAddr, server: SocketAddr) -> Option<u32> {
    let (client, server) = (canonical(client), canonical(server));
    sockets(table)
        .find(|(local, remote, _)| *local == client && *remote == server)
        .map(|(_, _, uid)| uid)
}

/// Who each `(client, server)` connection is, as seen by our socket at
/// `server`. A loopback client's owner is asked of the kernel one socket
/// at a time ([`crate::sys::SockDiag`]): its cost does not grow with the
/// machine's connection table. Where that lookup is not available (or does
/// not find the socket), the procfs tables under `net` (`/proc/net`) are
/// read, each at most once for the whole batch, `tcp` and `tcp6` both: a
/// client may reach a dual-stack listener from an IPv4 socket (listed in
/// `tcp`) or from an IPv6 one bound to `::ffff:a.b.c.d` (listed in `tcp6`).
pub(crate) fn identify(net: &Path, connections: &[(SocketAddr, SocketAddr)]) -> Vec<Peer> {
    identify_with(crate::sys::SockDiag::open().ok(), net, connections)
}

fn identify_with(
    diag: Option<crate::sys::SockDiag>,
    net: &Path,
    connections: &[(SocketAddr, SocketAddr)],
) -> Vec<Peer> {
    let mut tables: Option<HashMap<(SocketAddr, SocketAddr), u32>> = None;
    let mut peers = Vec::with_capacity(connections.len());
    for (client, server) in connections {
        let (client, server) = (canonical(*client), canonical(*server));
        if !client.ip().is_loopback() {
            peers.push(Peer::Ip(client.ip()));
            continue;
        }
        let asked = diag
            .as_ref()
            .and_then(|d| d.tcp_owner(client, server).ok().flatten());
        let owner = asked.or_else(|| {
            tables
                .get_or_insert_with(|| read_tables(net))
                .get(&(client, server))
                .copied()
        });
        peers.push(owner.map_or(Peer::Ip(client.ip()), Peer::Uid));
    }
    peers
}

/// Every TCP socket of `tcp` and `tcp6` under `net`, by (local, remote).
fn read_tables(net: &Path) -> HashMap<(SocketAddr, SocketAddr), u32> {
    let mut owners = HashMap::new();
    for file in ["tcp", "tcp6"] {
        if let Ok(table) = std::fs::read_to_string(net.join(file)) {
            owners.extend(sockets(&table).map(|(l, r, uid)| ((l, r), uid)));
        }
    }
    owners
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// Hex of an IPv4 address as the kernel prints it on this machine.
    fn hex4(ip: [u8; 4]) -> String {
        format!("{:08X}", u32::from_ne_bytes(ip))
    }

    #[test]
    fn finds_the_owner_of_the_clients_socket() {
        let lo = hex4([127, 0, 0, 1]);
        let table = format!(
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             \x20  0: {lo}:24F8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n\
             \x20  1: {lo}:24F8 {lo}:D431 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n\
             \x20  2: {lo}:D431 {lo}:24F8 01 00000000:00000000 00:00000000 00000000 65534        0 3 1\n\
             \x20  3: {lo}:D432 {lo}:24F8 01 00000000:00000000 00:00000000 00000000  1000        0 4 1\n"
        );
        let server = addr("127.0.0.1:9464");
        assert_eq!(
            owner_in(&table, addr("127.0.0.1:54321"), server),
            Some(65534)
        );
        assert_eq!(
            owner_in(&table, addr("127.0.0.1:54322"), server),
            Some(1000)
        );
        // The server's own end of the connection is not the client's.
        assert_eq!(owner_in(&table, addr("127.0.0.1:9999"), server), None);
        // A dual-stack listener sees IPv4 clients as mapped addresses.
        assert_eq!(
            owner_in(
                &table,
                addr("[::ffff:127.0.0.1]:54321"),
                addr("[::ffff:127.0.0.1]:9464")
            ),
            Some(65534)
        );
    }

    #[test]
    fn reads_ipv6_tables() {
        let words: String = Ipv6Addr::LOCALHOST
            .octets()
            .chunks(4)
            .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
            .collect();
        let table = format!(
            "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             \x20  0: {words}:C350 {words}:24F8 01 00000000:00000000 00:00000000 00000000  1234        0 9 1\n"
        );
        assert_eq!(
            owner_in(&table, addr("[::1]:50000"), addr("[::1]:9464")),
            Some(1234)
        );
    }

    #[test]
    fn malformed_tables_find_nobody() {
        let server = addr("127.0.0.1:9464");
        let client = addr("127.0.0.1:54321");
        for table in [
            "",
            "header only\n",
            "h\n 0: zz:zz yy:yy\n",
            "h\n 0: 0100007F 0100007F:24F8 01 0 0 0 uid\n",
            "h\n 0: 0100007F:D431 0100007F:24F8 01 0 0 0 notanumber\n",
            "h\n 0: 0100007F:D431\n",
        ] {
            assert_eq!(owner_in(table, client, server), None, "{table:?}");
        }
    }

    #[test]
    fn remote_clients_are_their_address() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            identify(
                dir.path(),
                &[
                    (addr("10.0.0.7:5000"), addr("10.0.0.1:9464")),
                    // Loopback without a readable table: the address stands in.
                    (addr("127.0.0.1:5000"), addr("127.0.0.1:9464")),
                ]
            ),
            [
                Peer::Ip("10.0.0.7".parse().unwrap()),
                Peer::Ip("127.0.0.1".parse().unwrap())
            ]
        );
    }

    #[test]
    fn a_mapped_client_is_found_in_tcp6() {
        // An IPv6 socket bound to ::ffff:127.0.0.5 is listed in tcp6 with
        // mapped addresses; the listener sees it as 127.0.0.5.
        let words = |ip: Ipv6Addr| -> String {
            ip.octets()
                .chunks(4)
                .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                .collect()
        };
        let client: Ipv6Addr = "::ffff:127.0.0.5".parse().unwrap();
        let server: Ipv6Addr = "::ffff:127.0.0.1".parse().unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tcp"), "header\n").unwrap();
        std::fs::write(
            dir.path().join("tcp6"),
            format!(
                "header\n   0: {}:C350 {}:24F8 01 00000000:00000000 00:00000000 00000000 65534 0 9 1\n",
                words(client),
                words(server)
            ),
        )
        .unwrap();
        assert_eq!(
            identify_with(
                None,
                dir.path(),
                &[(
                    addr("[::ffff:127.0.0.5]:50000"),
                    addr("[::ffff:127.0.0.1]:9464")
                )]
            ),
            [Peer::Uid(65534)]
        );
    }

    #[test]
    fn a_real_loopback_connection_is_its_owner() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let server = listener.local_addr().unwrap();
        let client = std::net::TcpStream::connect(server).unwrap();
        let (_conn, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        let me = std::fs::metadata("/proc/self").map(|m| {
            use std::os::unix::fs::MetadataExt;
            m.uid()
        });
        let me = me.unwrap();
        assert_eq!(
            identify(Path::new("/proc/net"), &[(peer, server)]),
            [Peer::Uid(me)]
        );
        // The kernel's one-socket lookup, and the tables without it.
        let diag = crate::sys::SockDiag::open().unwrap();
        assert_eq!(diag.tcp_owner(peer, server).unwrap(), Some(me));
        assert_eq!(
            identify_with(None, Path::new("/proc/net"), &[(peer, server)]),
            [Peer::Uid(me)]
        );
    }
}
