//! The KV-event codec against bytes written by vLLM's own encoder (msgspec), its decoder
//! against malformed input, and the ZMQ publisher end to end: a `zeromq` SUB socket
//! receives what is published, a DEALER asks the replay socket for what it missed.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use strata_engine::kv_events::{
    decode_batch, decode_replay_reply, encode_batch, parse_seq, seq_bytes, topic, DecodeError,
    EventEncoding, KvEvent, KvEventBatch, KvEventPublisher, KvEventsConfig, KvEventsError,
    ReplayFrame, END_SEQ, MAX_DEPTH,
};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

// ---------------------------------------------------------------------------------------
// Codec: golden bytes from msgspec.
//
// Produced with msgspec 0.23 from vLLM's struct definitions (vllm/distributed/kv_events.py):
// `EventBatch(array_like=True, omit_defaults=True)` with `ts, events, data_parallel_rank`;
// MAP: `KVCacheEvent(omit_defaults=True, tag=True)` (current vLLM, after #42892) with
// `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
// lora_name, extra_keys=None, group_idx=None, kv_cache_spec_kind=None,
// kv_cache_spec_sliding_window=None)` and `BlockRemoved(block_hashes, medium, group_idx=None)`;
// ARRAY: the same with `array_like=True` and the fields up to `lora_name` (vLLM between
// #27577 and #33304); ARRAY_09: vLLM 0.9 (no medium, no lora_name); ARRAY_X: the array era
// after #33304 (`extra_keys`, `group_idx` appended).
// ---------------------------------------------------------------------------------------

const MAP: &str = "93cb41da3054981000009588a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739301cf8000000000000005cfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647398ce0001f400007fcc80ccffcd0100cdffffce00010000aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c088a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573912ab1706172656e745f626c6f636b5f6861736807a9746f6b656e5f696473920102aa626c6f636b5f73697a6502a76c6f72615f696403a66d656469756da3435055a96c6f72615f6e616d65a9616461707465722d7883a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392012aa66d656469756da347505583a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739109a66d656469756dc081a474797065b0416c6c426c6f636b73436c656172656400";
const ARRAY: &str = "93cb41da3054981000009598ab426c6f636b53746f7265649301cf8000000000000005cfffffffffffffffffc098ce0001f400007fcc80ccffcd0100cdffffce0001000010c0a3475055c098ab426c6f636b53746f726564912a079201020203a3435055a9616461707465722d7893ac426c6f636b52656d6f76656492012aa347505593ac426c6f636b52656d6f7665649109c091b0416c6c426c6f636b73436c656172656400";
const MAP_NO_RANK: &str = "93cb40000000000000009181a474797065b0416c6c426c6f636b73436c6561726564c0";
const MAP_NEWER_FIELDS: &str = "93cb400c000000000000928ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c42000000000000000000000000000000000000000000000000000000000000000054db1706172656e745f626c6f636b5f68617368c4201111111111111111111111111111111111111111111111111111111111111111a9746f6b656e5f6964739103aa626c6f636b5f73697a6501a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739191a473616c74a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739101a66d656469756da3475055a967726f75705f6964780201";
const ARRAY_09: &str = "93cb40100000000000009296ab426c6f636b53746f726564910a0992050602c092ac426c6f636b52656d6f766564910a00";
const ARRAY_X: &str =
    "93cb4010000000000000919aab426c6f636b53746f726564910ac092050602c0a3475055a16c91c00000";

fn unhex(s: &str) -> Vec<u8> {
    hex::decode(s).expect("test vector is hex")
}

fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, block_size: usize) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens,
        block_size,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
    }
}

fn golden_batch() -> KvEventBatch {
    KvEventBatch {
        ts: 1757500000.25,
        events: vec![
            stored(
                vec![1, (1 << 63) + 5, u64::MAX],
                None,
                vec![128000, 0, 127, 128, 255, 256, 65535, 65536],
                16,
            ),
            KvEvent::BlockStored {
                block_hashes: vec![42],
                parent_block_hash: Some(7),
                token_ids: vec![1, 2],
                block_size: 2,
                lora_id: Some(3),
                medium: Some("CPU".into()),
                lora_name: Some("adapter-x".into()),
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![1, 42],
                medium: Some("GPU".into()),
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![9],
                medium: None,
            },
            KvEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(0),
    }
}

#[test]
fn map_encoding_is_byte_identical_to_current_vllm() {
    let batch = golden_batch();
    assert_eq!(hex::encode(encode_batch(&batch, EventEncoding::Map)), MAP);
    assert_eq!(decode_batch(&unhex(MAP)), Ok(batch));
}

#[test]
fn array_encoding_is_byte_identical_to_pre_map_vllm() {
    let batch = golden_batch();
    assert_eq!(
        hex::encode(encode_batch(&batch, EventEncoding::Array)),
        ARRAY
    );
    assert_eq!(decode_batch(&unhex(ARRAY)), Ok(batch));
}

#[test]
fn rank_none_is_an_explicit_nil() {
    let batch = KvEventBatch {
        ts: 2.0,
        events: vec![KvEvent::AllBlocksCleared],
        data_parallel_rank: None,
    };
    assert_eq!(
        hex::encode(encode_batch(&batch, EventEncoding::Map)),
        MAP_NO_RANK
    );
    assert_eq!(decode_batch(&unhex(MAP_NO_RANK)), Ok(batch));
    // A two-element batch (rank omitted) is accepted too.
    let two = unhex("92cb4000000000000000" /* [2.0, */);
    let mut two = two;
    two.extend_from_slice(&unhex("90")); // []]
    let decoded = decode_batch(&two).expect("two-element batch");
    assert_eq!(decoded.data_parallel_rank, None);
    assert!(decoded.events.is_empty());
}

#[test]
fn newer_vllm_fields_are_ignored_and_byte_hashes_folded() {
    let batch = decode_batch(&unhex(MAP_NEWER_FIELDS)).expect("decodes");
    assert_eq!(batch.ts, 3.5);
    assert_eq!(batch.data_parallel_rank, Some(1));
    assert_eq!(
        batch.events,
        vec![
            stored(vec![5, 77], Some(0x1111_1111_1111_1111), vec![3], 1),
            KvEvent::BlockRemoved {
                block_hashes: vec![1],
                medium: Some("GPU".into())
            },
        ]
    );
}

#[test]
fn older_array_shapes_decode() {
    let batch = decode_batch(&unhex(ARRAY_09)).expect("vLLM 0.9 shape");
    assert_eq!(
        batch.events,
        vec![
            KvEvent::BlockStored {
                block_hashes: vec![10],
                parent_block_hash: Some(9),
                token_ids: vec![5, 6],
                block_size: 2,
                lora_id: None,
                medium: None,
                lora_name: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![10],
                medium: None
            },
        ]
    );
    let batch = decode_batch(&unhex(ARRAY_X)).expect("array with extra_keys, group_idx");
    assert_eq!(
        batch.events,
        vec![KvEvent::BlockStored {
            block_hashes: vec![10],
            parent_block_hash: None,
            token_ids: vec![5, 6],
            block_size: 2,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: Some("l".into()),
        }]
    );
}

#[test]
fn negative_hashes_keep_their_bits() {
    // [0.0, [["BlockRemoved", [-1, -2], nil]], 0]
    let payload = unhex("93cb00000000000000009193ac426c6f636b52656d6f76656492fffec000");
    let batch = decode_batch(&payload).expect("decodes");
    assert_eq!(
        batch.events,
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![u64::MAX, u64::MAX - 1],
            medium: None
        }]
    );
}

fn err(hex: &str) -> DecodeError {
    match decode_batch(&unhex(hex)) {
        Ok(b) => panic!("{hex} decoded to {b:?}"),
        Err(e) => e,
    }
}

#[test]
fn malformed_payloads_are_typed_errors() {
    assert!(matches!(
        decode_batch(&[]),
        Err(DecodeError::Truncated { .. })
    ));
    // Not an array.
    assert!(matches!(err("c0"), DecodeError::UnexpectedType { .. }));
    // [1.0]
    assert_eq!(err("91cb3ff0000000000000"), DecodeError::BatchArity(1));
    // [1.0, [], 0] + trailing byte
    assert_eq!(
        err("93cb3ff0000000000000900000"),
        DecodeError::TrailingBytes(1)
    );
    // Unknown event type: [1.0, [["Nope"]], 0]
    assert_eq!(
        err("93cb3ff00000000000009191a44e6f706500"),
        DecodeError::UnknownEventType("Nope".into())
    );
    // Map event without "type": [1.0, [{"medium": nil}], 0]
    assert_eq!(
        err("93cb3ff00000000000009181a66d656469756dc000"),
        DecodeError::MissingTag
    );
    // BlockRemoved map without block_hashes: [1.0, [{"type": "BlockRemoved"}], 0]
    assert!(matches!(
        err("93cb3ff00000000000009181a474797065ac426c6f636b52656d6f76656400"),
        DecodeError::MissingField {
            field: "block_hashes",
            ..
        }
    ));
    // Duplicate key: {"type": "AllBlocksCleared", "type": "AllBlocksCleared"}
    assert!(matches!(
        err("93cb3ff00000000000009182a474797065b0416c6c426c6f636b73436c6561726564a474797065b0416c6c426c6f636b73436c656172656400"),
        DecodeError::DuplicateField { field: "type", .. }
    ));
    // A token id above u32: ["BlockStored", [1], nil, [2^32], 1]
    assert_eq!(
        err("93cb3ff00000000000009195ab426c6f636b53746f7265649101c091cf00000001000000000100"),
        DecodeError::OutOfRange { field: "token_ids" }
    );
    // An event that is an empty array.
    assert_eq!(err("93cb3ff0000000000000919000"), DecodeError::EmptyEvent);
    // Invalid UTF-8 in the tag.
    assert!(matches!(
        err("93cb3ff00000000000009191a2ff0000"),
        DecodeError::InvalidUtf8(_)
    ));
    // A huge claimed array length is refused before anything is allocated.
    assert!(matches!(
        err("93cb3ff0000000000000ddffffffff"),
        DecodeError::Truncated { .. }
    ));
}

#[test]
fn unknown_fields_nested_too_deep_are_refused() {
    // [1.0, [{"type": "AllBlocksCleared", "x": [[[...nil...]]]}], 0]
    let mut payload =
        unhex("93cb3ff00000000000009182a474797065b0416c6c426c6f636b73436c6561726564a178");
    payload.extend(std::iter::repeat_n(0x91u8, MAX_DEPTH + 2));
    payload.push(0xc0);
    payload.push(0x00);
    assert_eq!(decode_batch(&payload), Err(DecodeError::TooDeep));
    // Shallow unknown fields of every kind are skipped.
    let mut ok = unhex("93cb3ff00000000000009182a474797065b0416c6c426c6f636b73436c6561726564a178");
    // ["s", b"\x01", 1.5, {1: true}, -3, ext]
    ok.extend(unhex("96a173c40101cb3ff800000000000081" /* {1: */));
    ok.extend(unhex("01c3fdd401aa" /* true}, -3, fixext1 */));
    ok.push(0x00);
    assert_eq!(
        decode_batch(&ok).map(|b| b.events),
        Ok(vec![KvEvent::AllBlocksCleared])
    );
}

#[test]
fn frames() {
    assert_eq!(seq_bytes(258), [0, 0, 0, 0, 0, 0, 1, 2]);
    assert_eq!(parse_seq(&[0, 0, 0, 0, 0, 0, 1, 2]), Ok(258));
    assert_eq!(parse_seq(&[1, 2]), Err(DecodeError::BadSeqLength(2)));
    assert_eq!(END_SEQ.to_be_bytes(), [0xFF; 8]);
    assert_eq!(decode_replay_reply(&[0xFF; 8], &[]), Ok(ReplayFrame::End));
    let payload = encode_batch(&golden_batch(), EventEncoding::Map);
    assert_eq!(
        decode_replay_reply(&seq_bytes(7), &payload),
        Ok(ReplayFrame::Batch {
            seq: 7,
            batch: golden_batch()
        })
    );
    assert_eq!(topic("pod-1", "llama-3"), "kv@pod-1@llama-3");
}

fn arb_event() -> impl Strategy<Value = KvEvent> {
    prop_oneof![
        (
            vec(any::<u64>(), 0..6),
            option::of(any::<u64>()),
            vec(any::<u32>(), 0..40),
            any::<u32>(),
            option::of(any::<i64>()),
            option::of("[A-Z]{0,5}"),
            option::of("\\PC{0,40}"),
        )
            .prop_map(
                |(
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                )| {
                    KvEvent::BlockStored {
                        block_hashes,
                        parent_block_hash,
                        token_ids,
                        block_size: block_size as usize,
                        lora_id,
                        medium,
                        lora_name,
                    }
                }
            ),
        (vec(any::<u64>(), 0..6), option::of("[A-Z]{0,5}")).prop_map(|(block_hashes, medium)| {
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            }
        }),
        Just(KvEvent::AllBlocksCleared),
    ]
}

fn arb_batch() -> impl Strategy<Value = KvEventBatch> {
    (
        -1e12f64..1e12,
        vec(arb_event(), 0..8),
        option::of(any::<i64>()),
    )
        .prop_map(|(ts, events, data_parallel_rank)| KvEventBatch {
            ts,
            events,
            data_parallel_rank,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decoder_never_panics_on_arbitrary_bytes(bytes in vec(any::<u8>(), 0..256)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn decoder_never_panics_on_damaged_payloads(
        batch in arb_batch(),
        map in any::<bool>(),
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let encoding = if map { EventEncoding::Map } else { EventEncoding::Array };
        let mut payload = encode_batch(&batch, encoding);
        for (at, byte) in edits {
            let i = at.index(payload.len());
            payload[i] = byte;
        }
        let _ = decode_batch(&payload);
        let end = cut.index(payload.len() + 1);
        let _ = decode_batch(&payload[..end]);
    }

    #[test]
    fn encode_decode_round_trips(batch in arb_batch(), map in any::<bool>()) {
        let encoding = if map { EventEncoding::Map } else { EventEncoding::Array };
        let payload = encode_batch(&batch, encoding);
        prop_assert_eq!(decode_batch(&payload), Ok(batch));
    }
}

// ---------------------------------------------------------------------------------------
// Publisher over ZMQ.
// ---------------------------------------------------------------------------------------

/// Everything network-facing in these tests gives up after this long.
const DEADLINE: Duration = Duration::from_secs(20);

fn local_config(topic: &str) -> KvEventsConfig {
    KvEventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: topic.into(),
        ..KvEventsConfig::default()
    }
}

/// A batch that marks slow-joiner probes, so the tests can tell them from real events.
fn probe() -> Vec<KvEvent> {
    vec![KvEvent::BlockRemoved {
        block_hashes: vec![u64::MAX],
        medium: Some("probe".into()),
    }]
}

struct Received {
    topic: Bytes,
    seq: u64,
    batch: KvEventBatch,
}

fn split(message: ZmqMessage) -> Received {
    let frames = message.into_vec();
    assert_eq!(frames.len(), 3, "a KV-event message has 3 frames");
    Received {
        topic: frames[0].clone(),
        seq: parse_seq(&frames[1]).expect("8-byte seq"),
        batch: decode_batch(&frames[2]).expect("payload decodes"),
    }
}

/// Handles the slow-joiner problem: a PUB socket drops messages until it has processed
/// the subscription, so publish probes until the subscriber sees one (bounded in time).
async fn wait_until_subscribed(publisher: &KvEventPublisher, sub: &mut SubSocket) {
    let start = Instant::now();
    while start.elapsed() < DEADLINE {
        assert!(publisher.publish(probe()));
        if let Ok(Ok(message)) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await
        {
            assert_eq!(split(message).batch.events, probe());
            return;
        }
    }
    panic!("the subscriber saw nothing within {DEADLINE:?}");
}

/// The next non-probe message.
async fn next_event(sub: &mut SubSocket) -> Received {
    let message = tokio::time::timeout(DEADLINE, async {
        loop {
            let received = split(sub.recv().await.expect("recv"));
            if received.batch.events != probe() {
                return received;
            }
        }
    })
    .await;
    message.expect("a message within the deadline")
}

fn mixed_sequence() -> Vec<Vec<KvEvent>> {
    vec![
        vec![stored(vec![11, 12], None, (0..32).collect(), 16)],
        vec![
            stored(vec![13], Some(12), (32..48).collect(), 16),
            KvEvent::BlockStored {
                block_hashes: vec![21],
                parent_block_hash: None,
                token_ids: vec![70000; 16],
                block_size: 16,
                lora_id: Some(1),
                medium: Some("GPU".into()),
                lora_name: Some("adapter".into()),
            },
        ],
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![13, 12],
            medium: Some("GPU".into()),
        }],
        vec![KvEvent::AllBlocksCleared],
        vec![stored(vec![11], None, (0..16).collect(), 16)],
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_receives_every_batch_in_order() {
    let topic_name = topic("engine-0", "smollm2");
    let (publisher, addrs) = KvEventPublisher::start(local_config(&topic_name)).expect("starts");
    let port = addrs.publisher_port().expect("bound port");
    assert_ne!(port, 0);

    let mut sub = SubSocket::new();
    sub.subscribe("kv@").await.expect("subscribe");
    sub.connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .expect("connect");
    wait_until_subscribed(&publisher, &mut sub).await;

    let before = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    let sequence = mixed_sequence();
    for events in &sequence {
        assert!(publisher.publish(events.clone()));
    }
    assert!(
        publisher.publish(Vec::new()),
        "an empty batch is accepted and not sent"
    );

    let mut last_seq = None;
    for events in &sequence {
        let got = next_event(&mut sub).await;
        assert_eq!(got.topic.as_ref(), topic_name.as_bytes());
        if let Some(last) = last_seq {
            assert_eq!(got.seq, last + 1, "sequence numbers increase by one");
        }
        last_seq = Some(got.seq);
        assert_eq!(&got.batch.events, events);
        assert_eq!(got.batch.data_parallel_rank, Some(0));
        assert!(got.batch.ts >= before - 1.0 && got.batch.ts < before + 60.0);
    }
    assert_eq!(publisher.dropped(), 0);
    let started = Instant::now();
    drop(publisher);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "drop stops the thread promptly"
    );
}

async fn replay(
    dealer: &mut DealerSocket,
    start: u64,
    delimiter: bool,
) -> Vec<(u64, KvEventBatch)> {
    let mut request = Vec::new();
    if delimiter {
        request.push(Bytes::new());
    }
    request.push(Bytes::copy_from_slice(&seq_bytes(start)));
    dealer
        .send(ZmqMessage::try_from(request).expect("frames"))
        .await
        .expect("send replay request");
    let mut got = Vec::new();
    let collected = tokio::time::timeout(DEADLINE, async {
        loop {
            let mut frames = dealer.recv().await.expect("replay reply").into_vec();
            if delimiter {
                assert_eq!(frames.len(), 3, "[\"\", seq, payload]");
                assert!(frames.remove(0).is_empty(), "empty delimiter first");
            } else {
                assert_eq!(frames.len(), 2, "[seq, payload]");
            }
            match decode_replay_reply(&frames[0], &frames[1]).expect("reply decodes") {
                ReplayFrame::Batch { seq, batch } => got.push((seq, batch)),
                ReplayFrame::End => return,
            }
        }
    })
    .await;
    collected.expect("replay ends within the deadline");
    got
}

async fn wait_sent(publisher: &KvEventPublisher, n: u64) {
    let start = Instant::now();
    while publisher.sent() + publisher.send_errors() < n {
        assert!(
            start.elapsed() < DEADLINE,
            "publisher did not send {n} messages"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_returns_buffered_messages_then_the_end_marker() {
    let config = KvEventsConfig {
        buffer_steps: 4,
        ..local_config("kv@replay@m")
    };
    let (publisher, addrs) = KvEventPublisher::start(config).expect("starts");
    let replay_port = addrs.replay_port().expect("replay bound");

    let mut dealer = DealerSocket::new();
    dealer
        .connect(&format!("tcp://127.0.0.1:{replay_port}"))
        .await
        .expect("connect");
    // Nothing published yet: just the end marker.
    assert!(replay(&mut dealer, 0, true).await.is_empty());

    let sequence = mixed_sequence();
    for events in &sequence {
        assert!(publisher.publish(events.clone()));
    }
    wait_sent(&publisher, sequence.len() as u64).await;

    // From seq 2: messages 2, 3, 4 (as REQ would frame it).
    let got = replay(&mut dealer, 2, true).await;
    assert_eq!(
        got.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    for (seq, batch) in &got {
        assert_eq!(batch.events, sequence[*seq as usize]);
    }
    // From 0: only the last 4 are buffered.
    let got = replay(&mut dealer, 0, false).await;
    assert_eq!(
        got.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    // Past the end: just the marker.
    assert!(replay(&mut dealer, 99, true).await.is_empty());
}

#[test]
fn a_full_queue_drops_and_counts_without_blocking() {
    let config = KvEventsConfig {
        queue_capacity: 1,
        replay_endpoint: None,
        ..local_config("kv@drop@m")
    };
    let (publisher, _) = KvEventPublisher::start(config).expect("starts");
    let mut accepted = 0u64;
    let mut refused = 0u64;
    let start = Instant::now();
    while refused == 0 && start.elapsed() < DEADLINE {
        let big = vec![stored((0..64).collect(), None, (0..1024).collect(), 16)];
        if publisher.publish(big) {
            accepted += 1;
        } else {
            refused += 1;
        }
    }
    assert!(refused > 0, "never filled a one-slot queue");
    assert_eq!(publisher.dropped(), refused);
    assert!(accepted > 0);
}

#[test]
fn start_reports_bad_endpoints_and_busy_ports() {
    let bad = |endpoint: &str| KvEventsConfig {
        endpoint: endpoint.into(),
        ..KvEventsConfig::default()
    };
    for endpoint in [
        "ipc:///tmp/x",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:99999",
        "tcp://:1",
    ] {
        assert!(
            matches!(
                KvEventPublisher::start(bad(endpoint)),
                Err(KvEventsError::InvalidEndpoint { .. })
            ),
            "{endpoint}"
        );
    }
    assert!(matches!(
        KvEventPublisher::start(KvEventsConfig {
            queue_capacity: 0,
            ..local_config("t")
        }),
        Err(KvEventsError::ZeroQueueCapacity)
    ));
    let (_first, addrs) = KvEventPublisher::start(local_config("t")).expect("starts");
    let taken = format!("tcp://127.0.0.1:{}", addrs.publisher_port().expect("port"));
    assert!(matches!(
        KvEventPublisher::start(bad(&taken)),
        Err(KvEventsError::Bind { .. })
    ));
}
