//! The protocol end to end: a client against a server over loopback, and hand-driven
//! peers that misbehave on either side.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use super::server::handshake;
use super::wire::{
    read_body, read_len, FrameBuf, Reader, E_PROTOCOL, K_BLOCKS, K_ERROR, K_GET, K_HELLO, K_PUT,
    K_READY, MAGIC,
};
use super::*;
use crate::kv::cache::KvDtype;

fn spec(model: &str) -> BlockSpec {
    BlockSpec {
        model: model.into(),
        block_size: 4,
        n_layer: 2,
        slot_width: 3,
        dtype: KvDtype::F16,
        scales_per_slot: 0,
    }
}

fn block(spec: &BlockSpec, n: u32) -> BlockData {
    let mut hash = [0u8; 32];
    hash[..4].copy_from_slice(&n.to_le_bytes());
    let bytes = (0..spec.block_bytes())
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(n) as u8)
        .collect();
    BlockData { hash, bytes }
}

const T: Duration = Duration::from_secs(5);

/// Serves `source` on a loopback port until the returned sender is dropped or fired.
async fn start(
    source: Arc<dyn BlockSource>,
    limits: ServeLimits,
) -> (
    SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(serve_with(
        listener,
        source,
        async move {
            let _ = rx.await;
        },
        limits,
    ));
    (addr, tx, task)
}

fn hello(spec: &BlockSpec) -> Vec<u8> {
    let mut f = FrameBuf::new(K_HELLO, 64);
    f.0.extend_from_slice(MAGIC);
    spec.encode(&mut f.0);
    f.finish()
}

/// Reads one frame from a raw stream: (kind, payload), or None at a clean close.
async fn raw_frame(s: &mut BufReader<TcpStream>) -> Option<(u8, Vec<u8>)> {
    let len = read_len(s).await.unwrap()?;
    Some(read_body(s, len).await.unwrap())
}

/// A hand-driven peer: accepts one connection on `listener`, reads the client's hello
/// and answers ready with `sp`, then returns the connection for the test to misbehave on.
async fn accept_and_greet(listener: TcpListener, sp: &BlockSpec) -> BufReader<TcpStream> {
    let (s, _) = listener.accept().await.unwrap();
    let mut s = BufReader::new(s);
    let _ = raw_frame(&mut s).await;
    let mut f = FrameBuf::new(K_READY, 64);
    sp.encode(&mut f.0);
    s.get_mut().write_all(&f.finish()).await.unwrap();
    s
}

#[tokio::test]
async fn get_put_release_and_evictions_round_trip() {
    let sp = spec("m1");
    let src = Arc::new(MemorySource::new(sp.clone()));
    for n in 1..=3 {
        src.insert(block(&sp, n));
    }
    let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;
    let mut c = TransferClient::connect(addr, &sp, T).await.unwrap();

    // The leading run only: block 4 is missing, so 3 after it is not sent.
    let asked = [
        block(&sp, 1).hash,
        block(&sp, 2).hash,
        block(&sp, 4).hash,
        block(&sp, 3).hash,
    ];
    let got = c.get(&asked, Some("req-1")).await.unwrap();
    assert_eq!(got, vec![block(&sp, 1), block(&sp, 2)]);
    assert_eq!(src.released(), vec!["req-1".to_string()]);

    c.put(vec![block(&sp, 4), block(&sp, 5)]).await.unwrap();
    assert!(src.contains(&block(&sp, 5).hash));
    let got = c.get(&asked, None).await.unwrap();
    assert_eq!(got.len(), 4);
    assert_eq!(got[2], block(&sp, 4));
    assert_eq!(got[3], block(&sp, 3));

    c.release("req-2").await.unwrap();
    assert_eq!(
        src.released(),
        vec!["req-1".to_string(), "req-2".to_string()]
    );
    let ev = c.evictions_since(7).await.unwrap();
    assert_eq!(
        ev,
        Evictions {
            next: 7,
            hashes: vec![],
            complete: true
        }
    );
    // An empty get with a pin only releases it.
    assert!(c.get(&[], Some("req-3")).await.unwrap().is_empty());
    assert_eq!(src.released().last().map(String::as_str), Some("req-3"));
}

#[tokio::test]
async fn long_gets_are_split_and_the_pin_goes_once_with_the_last_chunk() {
    let sp = BlockSpec {
        block_size: 1,
        n_layer: 1,
        slot_width: 1,
        ..spec("tiny")
    };
    let src = Arc::new(MemorySource::new(sp.clone()));
    let n = MAX_HASHES_PER_GET as u32 + 100;
    for i in 0..n {
        src.insert(block(&sp, i));
    }
    let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;
    let mut c = TransferClient::connect(addr, &sp, T).await.unwrap();
    let hashes: Vec<HashKey> = (0..n).map(|i| block(&sp, i).hash).collect();
    let got = c.get(&hashes, Some("p")).await.unwrap();
    assert_eq!(got.len(), n as usize);
    assert!(got.iter().zip(&hashes).all(|(b, h)| b.hash == *h));
    assert_eq!(src.released(), vec!["p".to_string()]);

    // A run that ends in the first chunk still releases the pin, once.
    let mut short = hashes.clone();
    short[10] = [0xEE; 32];
    let got = c.get(&short, Some("q")).await.unwrap();
    assert_eq!(got.len(), 10);
    assert_eq!(src.released(), vec!["p".to_string(), "q".to_string()]);
}

#[tokio::test]
async fn a_spec_mismatch_is_refused_on_both_sides() {
    let ours = spec("model-a");
    let src = Arc::new(MemorySource::new(ours.clone()));
    let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;

    // The server refuses a client of another model, naming what it serves.
    let other = spec("model-b");
    match TransferClient::connect(addr, &other, T).await {
        Err(TransferError::SpecMismatch { ours: o, theirs }) => {
            assert!(o.contains("model-b"), "{o}");
            assert!(theirs.contains("model-a"), "{theirs}");
        }
        r => panic!("expected a spec mismatch, got {r:?}"),
    }
    // ... and one of another shape or dtype.
    let shape = BlockSpec {
        dtype: KvDtype::F32,
        scales_per_slot: 0,
        ..ours.clone()
    };
    assert!(matches!(
        TransferClient::connect(addr, &shape, T).await,
        Err(TransferError::SpecMismatch { .. })
    ));
    // The server side sees the same mismatch.
    assert!(matches!(
        handshake(K_HELLO, &hello(&other)[6..], src.as_ref()),
        Err(TransferError::SpecMismatch { .. })
    ));

    // A peer that accepts but answers with another spec is refused by the client.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let liar = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _s = accept_and_greet(listener, &spec("model-z")).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    });
    match TransferClient::connect(liar, &ours, T).await {
        Err(TransferError::SpecMismatch { theirs, .. }) => assert!(theirs.contains("model-z")),
        r => panic!("expected a spec mismatch, got {r:?}"),
    }
    // The real server is still fine for a matching client.
    assert!(TransferClient::connect(addr, &ours, T).await.is_ok());
}

#[tokio::test]
async fn a_silent_peer_times_out_within_the_bound() {
    let sp = spec("m");
    // Accepts and never answers the handshake.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (s, _) = listener.accept().await.unwrap();
            held.push(s);
        }
    });
    let t0 = Instant::now();
    let r = TransferClient::connect(addr, &sp, Duration::from_millis(200)).await;
    assert!(matches!(r, Err(TransferError::Timeout)), "{r:?}");
    assert!(t0.elapsed() < Duration::from_secs(2));

    // Handshakes, then goes silent on the first request.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sp2 = sp.clone();
    tokio::spawn(async move {
        let _s = accept_and_greet(listener, &sp2).await;
        tokio::time::sleep(Duration::from_secs(30)).await;
    });
    let mut c = TransferClient::connect(addr, &sp, Duration::from_millis(200))
        .await
        .unwrap();
    let t0 = Instant::now();
    let r = c.get(&[[1; 32]], Some("pin")).await;
    assert!(matches!(r, Err(TransferError::Timeout)), "{r:?}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    // The conversation is out of step now: later calls fail at once.
    let r = c.release("pin").await;
    assert!(matches!(r, Err(TransferError::Io(_))), "{r:?}");
}

#[tokio::test]
async fn a_peer_that_closes_mid_frame_is_an_error() {
    let sp = spec("m");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sp2 = sp.clone();
    tokio::spawn(async move {
        let mut s = accept_and_greet(listener, &sp2).await;
        let _ = raw_frame(&mut s).await;
        // Announces 1,000 bytes, sends a few, hangs up.
        let mut part = 1000u32.to_le_bytes().to_vec();
        part.extend_from_slice(&[PROTOCOL_VERSION, K_BLOCKS, 1, 0, 0]);
        s.get_mut().write_all(&part).await.unwrap();
    });
    let mut c = TransferClient::connect(addr, &sp, T).await.unwrap();
    let r = c.get(&[[1; 32]], None).await;
    assert!(matches!(r, Err(TransferError::Protocol(_))), "{r:?}");
}

#[tokio::test]
async fn bad_frames_cost_only_their_connection() {
    let sp = spec("m");
    let src = Arc::new(MemorySource::new(sp.clone()));
    src.insert(block(&sp, 1));
    let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;
    let mut good = TransferClient::connect(addr, &sp, T).await.unwrap();

    async fn raw(addr: SocketAddr, sp: &BlockSpec) -> BufReader<TcpStream> {
        let mut s = BufReader::new(TcpStream::connect(addr).await.unwrap());
        s.get_mut().write_all(&hello(sp)).await.unwrap();
        assert_eq!(raw_frame(&mut s).await.unwrap().0, K_READY);
        s
    }
    async fn refused_then_closed(s: &mut BufReader<TcpStream>) {
        let (kind, payload) = raw_frame(s).await.unwrap();
        assert_eq!(kind, K_ERROR);
        assert_eq!(payload[0], E_PROTOCOL);
        assert!(raw_frame(s).await.is_none(), "connection should be closed");
    }

    // A frame over the limit: refused from its header, nothing allocated for it.
    let mut s = raw(addr, &sp).await;
    let huge = (MAX_FRAME_BYTES as u32 + 1).to_le_bytes();
    s.get_mut().write_all(&huge).await.unwrap();
    refused_then_closed(&mut s).await;

    // Too many hashes in one get.
    let mut s = raw(addr, &sp).await;
    let n = MAX_HASHES_PER_GET + 1;
    let mut f = FrameBuf::new(K_GET, 8 + n * 32);
    f.0.push(0);
    f.0.extend_from_slice(&(n as u32).to_le_bytes());
    f.0.extend(std::iter::repeat_n(7u8, n * 32));
    s.get_mut().write_all(&f.finish()).await.unwrap();
    refused_then_closed(&mut s).await;

    // A count that promises more hashes than the frame holds.
    let mut s = raw(addr, &sp).await;
    let mut f = FrameBuf::new(K_GET, 8);
    f.0.push(0);
    f.0.extend_from_slice(&1000u32.to_le_bytes());
    f.0.extend_from_slice(&[1; 32]);
    s.get_mut().write_all(&f.finish()).await.unwrap();
    refused_then_closed(&mut s).await;

    // A put whose blocks are not the spec's size, an unknown kind, a wrong version.
    for frame in [
        {
            let mut f = FrameBuf::new(K_PUT, 64);
            f.0.extend_from_slice(&1u32.to_le_bytes());
            f.0.extend_from_slice(&[0; 40]);
            f.finish()
        },
        FrameBuf::new(0x42, 0).finish(),
        vec![2, 0, 0, 0, 9, K_GET],
    ] {
        let mut s = raw(addr, &sp).await;
        s.get_mut().write_all(&frame).await.unwrap();
        refused_then_closed(&mut s).await;
    }

    // Garbage instead of a handshake.
    let mut s = BufReader::new(TcpStream::connect(addr).await.unwrap());
    s.get_mut()
        .write_all(&[5, 0, 0, 0, 1, K_HELLO, 1, 2, 3])
        .await
        .unwrap();
    refused_then_closed(&mut s).await;

    // The well-behaved client was never disturbed.
    let got = good.get(&[block(&sp, 1).hash], None).await.unwrap();
    assert_eq!(got, vec![block(&sp, 1)]);
}

#[tokio::test]
async fn a_refused_put_keeps_the_connection_and_bad_blocks_never_leave() {
    let sp = spec("m");
    let src = Arc::new(MemorySource {
        refuse_puts: true,
        ..MemorySource::new(sp.clone())
    });
    src.insert(block(&sp, 1));
    let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;
    let mut c = TransferClient::connect(addr, &sp, T).await.unwrap();
    let r = c.put(vec![block(&sp, 2)]).await;
    assert!(matches!(r, Err(TransferError::Refused(_))), "{r:?}");
    assert!(!src.contains(&block(&sp, 2).hash));
    // Wrong size: refused before anything is sent.
    let bad = BlockData {
        hash: [9; 32],
        bytes: vec![0; 3],
    };
    assert!(matches!(
        c.put(vec![bad]).await,
        Err(TransferError::Protocol(_))
    ));
    assert_eq!(c.get(&[block(&sp, 1).hash], None).await.unwrap().len(), 1);
}

#[tokio::test]
async fn idle_connections_are_closed_and_shutdown_ends_the_server() {
    let sp = spec("m");
    let src = Arc::new(MemorySource::new(sp.clone()));
    let limits = ServeLimits {
        idle: Duration::from_millis(100),
        ..Default::default()
    };
    let (addr, stop, task) = start(src, limits).await;
    let mut c = TransferClient::connect(addr, &sp, T).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(c.get(&[[1; 32]], None).await.is_err());

    let _open = TransferClient::connect(addr, &sp, T).await.unwrap();
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("serve ends on shutdown")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn eight_bit_specs_cross_the_wire_and_meet_only_their_own() {
    let int8 = BlockSpec {
        dtype: KvDtype::Int8,
        scales_per_slot: 3,
        ..spec("model-a")
    };
    // 2 kinds × 2 layers × 4 slots × (3 codes + 3 scales of 4 bytes).
    assert_eq!(int8.block_bytes(), 2 * 2 * 4 * (3 + 3 * 4));
    let src = Arc::new(MemorySource::new(int8.clone()));
    let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;
    // The same 8-bit spec round-trips through the handshake and is accepted.
    assert!(TransferClient::connect(addr, &int8, T).await.is_ok());
    // Another 8-bit format, another scale layout, or the f16 cache of the same model
    // is another block: never exchanged.
    for other in [
        BlockSpec {
            dtype: KvDtype::Fp8E4m3,
            ..int8.clone()
        },
        BlockSpec {
            scales_per_slot: 1,
            ..int8.clone()
        },
        spec("model-a"),
    ] {
        match TransferClient::connect(addr, &other, T).await {
            Err(TransferError::SpecMismatch { ours, theirs }) => {
                assert!(theirs.contains("dtype=int8 scales_per_slot=3"), "{theirs}");
                assert_ne!(ours, theirs);
            }
            r => panic!("expected a spec mismatch for {other}, got {r:?}"),
        }
    }
    let mut wire = Vec::new();
    int8.encode(&mut wire);
    let mut r = Reader::new(&wire);
    assert_eq!(BlockSpec::decode(&mut r).unwrap(), int8);
}

#[test]
fn specs_that_cannot_be_served_are_rejected() {
    let int8 = BlockSpec {
        dtype: KvDtype::Int8,
        scales_per_slot: 3,
        ..spec("m")
    };
    assert!(int8.validate().is_ok());
    for scales_per_slot in [0, 2] {
        assert!(BlockSpec {
            scales_per_slot,
            ..int8.clone()
        }
        .validate()
        .is_err());
    }
    assert!(BlockSpec {
        scales_per_slot: 3,
        ..spec("m")
    }
    .validate()
    .is_err());
    assert!(spec("m").validate().is_ok());
    assert_eq!(spec("m").block_bytes(), 2 * 2 * 4 * 3 * 2);
    assert!(spec("").validate().is_err());
    assert!(BlockSpec {
        block_size: 0,
        ..spec("m")
    }
    .validate()
    .is_err());
    let huge = BlockSpec {
        n_layer: u32::MAX,
        slot_width: u32::MAX,
        ..spec("m")
    };
    assert_eq!(huge.block_bytes(), usize::MAX);
    assert!(huge.validate().is_err());
}

/// A `BlockSource` over a map: blocks of one spec, no eviction log, pins recorded so a
/// test can see releases; puts refused when `refuse_puts` (an engine does that).
#[derive(Debug, Default)]
struct MemorySource {
    pub spec: Option<BlockSpec>,
    pub refuse_puts: bool,
    inner: std::sync::Mutex<MemoryInner>,
}

#[derive(Debug, Default)]
struct MemoryInner {
    blocks: HashMap<HashKey, Vec<u8>>,
    released: Vec<String>,
}

impl MemorySource {
    /// A source that accepts exactly `spec`.
    fn new(spec: BlockSpec) -> Self {
        Self {
            spec: Some(spec),
            refuse_puts: false,
            inner: Default::default(),
        }
    }

    fn insert(&self, block: BlockData) {
        self.lock().blocks.insert(block.hash, block.bytes);
    }

    fn contains(&self, hash: &HashKey) -> bool {
        self.lock().blocks.contains_key(hash)
    }

    /// The pins released so far, in order.
    fn released(&self) -> Vec<String> {
        self.lock().released.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryInner> {
        // The map stays consistent across a panic elsewhere (every edit is one call).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl BlockSource for MemorySource {
    fn accepts(&self, spec: &BlockSpec) -> bool {
        self.spec.as_ref() == Some(spec)
    }
    fn get(
        &self,
        _spec: &BlockSpec,
        hashes: Vec<HashKey>,
        release: Option<String>,
    ) -> BoxFuture<Vec<BlockData>> {
        let mut g = self.lock();
        let out: Vec<BlockData> = hashes
            .iter()
            .map_while(|h| {
                g.blocks.get(h).map(|b| BlockData {
                    hash: *h,
                    bytes: b.clone(),
                })
            })
            .collect();
        if let Some(p) = release {
            g.released.push(p);
        }
        Box::pin(async move { out })
    }
    fn put(&self, _spec: &BlockSpec, blocks: Vec<BlockData>) -> BoxFuture<Result<(), String>> {
        if self.refuse_puts {
            return Box::pin(async { Err("an engine does not take blocks".to_string()) });
        }
        let mut g = self.lock();
        for b in blocks {
            g.blocks.insert(b.hash, b.bytes);
        }
        Box::pin(async { Ok(()) })
    }
    fn evictions_since(&self, _spec: &BlockSpec, seq: u64) -> Evictions {
        Evictions {
            next: seq,
            hashes: Vec::new(),
            complete: true,
        }
    }
    fn release(&self, pin: String) -> BoxFuture<()> {
        self.lock().released.push(pin);
        Box::pin(async {})
    }
    fn own_spec(&self) -> Option<BlockSpec> {
        self.spec.clone()
    }
}
