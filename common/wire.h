// Wire formats of the disaggregated runtime (docs/architecture.md, "Per-step control, per-layer data"):
// the step plan the controller sends once per step to every rank, the header that precedes each
// per-layer payload between compute and memory ranks, and the control messages of a compute <->
// memory connection (hello, hello reply, release, error, bye).
//
// Every value is written byte by byte, little-endian, at a fixed offset: no struct is copied to
// the wire, so the layout depends on neither padding nor host byte order. Floats travel as their
// IEEE-754 binary32 bit pattern. Booleans are one byte, 0 or 1. Reserved bytes are written as 0
// and must read as 0. Strings are a length then that many bytes, without a terminator.
//
// Frame (every format): a 16-byte frame header, then the body.
//
//   offset  size  field         notes
//   ------  ----  ------------  ----------------------------------------------------------------
//        0     4  magic         4 ASCII bytes naming the format, in this order (u32 LE value):
//                                 'T','D','S','P' step plan            0x50534454
//                                 'T','D','L','M' layer message header 0x4d4c4454
//                                 'T','D','H','I' hello                0x49484454
//                                 'T','D','H','R' hello reply          0x52484454
//                                 'T','D','R','L' release              0x4c524454
//                                 'T','D','E','R' error                0x52454454
//                                 'T','D','B','Y' bye                  0x59424454
//                                 'T','D','S','Q' stats request        0x51534454
//                                 'T','D','M','S' memory stats         0x534d4454
//                                 'T','D','C','H' compute hello        0x48434454
//                                 'T','D','R','S' replica step         0x53524454
//                                 'T','D','R','R' replica result       0x52524454
//                                 'T','D','R','T' restore reply        0x54524454
//                                 'T','D','H','B' heartbeat            0x42484454
//                                 'T','D','H','A' heartbeat reply      0x41484454
//                                 'T','D','R','G' replica ring         0x47524454
//                                 'T','D','S','D' step discard         0x44534454
//                                 'T','D','P','B' persisted blocks     0x42504454
//                                 'T','D','M','J' memory rejoin        0x4a4d4454
//                                 'T','D','H','S' head split           0x53484454
//        4     2  version       u16, kWireVersion (13); a newer one decodes as Unimplemented, an
//                               older one as InvalidArgument (one build runs every rank).
//                               Version 2 added the hello's partition and KV head slice (its
//                               body grew from 56 to 64 bytes); version 3 the step plan's
//                               micro-batch fields (its fixed part grew from 24 to 32 bytes) and
//                               the hello's lanes; version 4 the step request's top_logprobs
//                               (its last byte, reserved before), the replica result's
//                               alternatives, the step plan's restores (KV tiers: restore_count
//                               in the fixed part's last 4 bytes, reserved before, and the
//                               PrefixRestore records after the evictions) and the restore reply;
//                               version 5 the heartbeat and its reply; version 6 the hello's
//                               slice_layers (its body grew from 64 to 72 bytes), the
//                               layer message kind 3 (residual) and the replica ring, and
//                               then the hello's q_first (its byte 66, reserved before) with
//                               the layer message kinds 4 (q) and 5 (kv); version 7 the
//                               step discard; version 8 the step plan's next-use records
//                               (next_use_count in the fixed part's bytes 26..27, reserved
//                               before, and the PrefixNextUse records after the restores);
//                               version 9 the evictions' tokens (each PrefixEvict record's
//                               token_count, reserved before, and the tokens after the next-use
//                               records), the hello reply's persisted byte (reserved before) and
//                               the persisted blocks report; version 10 the restores' segments
//                               (each PrefixRestore record's segment_count, reserved before, and
//                               the PrefixSegment records after the evictions' tokens) and the
//                               hello's rope (its body grew from 72 to 112 bytes); version 11
//                               the step discard's lost memory ranks (lost_count in its bytes
//                               18..19, reserved before, and the ranks after its 24 bytes);
//                               version 12 the hello's compute_mask (its byte 68, reserved
//                               before) and the memory rejoin; version 13 the head split and
//                               the step discard's drop (its byte 17, reserved before); the
//                               other layouts are unchanged
//        6     2  header_bytes  u16, size of this frame header: 16 in versions 1 to 13
//        8     4  body_bytes    u32, bytes that follow the frame header; the frame ends there
//       12     4  body_crc32c   u32, Crc32c() of the body bytes
//
// Step plan body (body_bytes = 32 + 64 * request_count + 24 * group_count + 32 * publish_count +
// 16 * evict_count + 24 * restore_count + 16 * next_use_count + 4 * (the evictions' token_count
// summed) + 16 * (the restores' segment_count summed); the records fill the body exactly):
//
//   offset  size  field          notes
//   ------  ----  -------------  ---------------------------------------------------------------
//        0     8  step_id        u64
//        8     4  request_count  u32  r: requests in the plan
//       12     4  group_count    u32  g: prefix groups
//       16     4  publish_count  u32  p: blocks to register
//       20     4  evict_count    u32  e: registered blocks to drop
//       24     1  micro_batch    u8   < micro_batches: this plan's micro-batch of the step
//       25     1  micro_batches  u8   in [1, kMaxMicroBatches]: plans the step is split into
//                                     (pipeline.batches); they share step_id and are sent in
//                                     micro_batch order before any of the step's layer data
//       26     2  next_use_count u16  n <= kMaxPrefixNextUses (2048): demoted blocks that waiting
//                                     requests will reuse; not 0 only in micro-batch 0
//       28     4  restore_count  u32  s: blocks to bring back from the rank's KV tiers
//       32  64*r  requests[r]    StepRequest records, each laid out as below (offsets relative)
//        R  24*g  groups[g]      PrefixGroup records; R = 32 + 64*r
//        G  32*p  publishes[p]   PrefixPublish records; G = R + 24*g
//        P  16*e  evictions[e]   PrefixEvict records; P = G + 32*p
//        E  24*s  restores[s]    PrefixRestore records; E = P + 16*e
//        S  16*n  next_uses[n]   PrefixNextUse records; S = E + 24*s
//        T   4*t  tokens[t]      i32 each: eviction 0's token_count tokens, then eviction 1's, and
//                                so on (t = their sum); T = S + 16*n
//        U  16*u  segments[u]    PrefixSegment records: restore 0's segment_count segments, then
//                                restore 1's, and so on (u = their sum); U = T + 4*t, and the body
//                                ends at U + 16*u
//
//   StepRequest record (64 bytes):
//        0     8  request_id     u64
//        8     8  seed           u64  sampling seed
//       16     8  counter        u64  sampling counter: index of the token this step draws
//       24     8  attach_hash    u64  0: the step attaches no registered prefix blocks; else the
//                                     hash of the block that ends the chain it attaches (which
//                                     covers exactly `position` tokens); not 0 needs position > 0
//       32     4  prefix_group   i32  -1: none, else < group_count: index of the request's
//                                     (deepest) group, whose memory_rank is the request's
//       36     4  position       i32  >= 0, first position of this step's rows
//       40     4  q_len          i32  >= 1, rows of this request in this step
//       44     4  kv_len         i32  >= q_len, context length after this step;
//                                     position + q_len <= kv_len
//       48     4  temperature    f32  finite, >= 0 (0: greedy)
//       52     4  top_k          i32  >= 0 (0: no top-k cut)
//       56     4  top_p          f32  in (0, 1]
//       60     2  memory_rank    u16  rank that owns the request's KV cache
//       62     1  sample         u8   0 or 1: the request's last row produces a token
//       63     1  top_logprobs   u8   in [0, kMaxTopLogprobs]: alternatives to report for the
//                                     sampled token (common/top_logprobs.h); memory ranks ignore it
//
//   PrefixGroup record (24 bytes):
//        0     8  block_hash     u64  hash of the registered block that ends the group's prefix
//        8     4  prefix_tokens  i32  >= 1, tokens of the prefix
//       12     4  parent         i32  -1: none, else < this group's index: the enclosing group,
//                                     with the same memory_rank and fewer prefix_tokens
//       16     2  memory_rank    u16
//       18     6  reserved       must be 0
//
//   PrefixPublish record (32 bytes; no two with the same memory_rank and block_hash):
//        0     8  request_id     u64  a request of this plan with the same memory_rank
//        8     8  block_hash     u64  hash the block is registered under
//       16     8  parent_hash    u64  hash of the block before it; 0 when block_index is 0
//       24     4  block_index    i32  >= 0: the block holds positions [block_index * B,
//                                     (block_index + 1) * B), B = the hello's prefix_block_tokens
//       28     2  memory_rank    u16
//       30     2  reserved       must be 0
//
//   PrefixEvict record (16 bytes; no two with the same memory_rank and block_hash):
//        0     8  block_hash     u64  hash of the registered block to drop
//        8     2  memory_rank    u16
//       10     2  token_count    u16  <= kMaxPrefixBlockTokens (4096): 0, or the block's tokens
//                                     (kv.tiers.persist: the rank writes them into the block's
//                                     file, so that a restarted deployment can register it again);
//                                     the tokens themselves are at the end of the body
//       12     4  reserved       must be 0
//
//   PrefixRestore record (24 bytes; no two with the same memory_rank and block_hash):
//        0     8  block_hash     u64  not 0: the block to load from the rank's KV tiers into free
//                                     slots and register (memory_node/kv_tier_store.h)
//        8     8  parent_hash    u64  the block before it (registered, or restored earlier in the
//                                     plan); 0 exactly when block_index is 0
//       16     4  block_index    i32  >= 0: its position in the chain
//       20     2  memory_rank    u16
//       22     2  segment_count  u16  <= kMaxPrefixSegments (16): 0, the block's own KV comes back
//                                     from the tiers; else (kv.store_pre_rope) the block is
//                                     assembled from rows of other registered blocks, the
//                                     segments at the end of the body
//
//   PrefixSegment record (16 bytes): rows of a registered block a shifted restore copies
//        0     8  source_hash    u64  not 0
//        8     4  source_index   i32  >= 0: the source's block_index
//       12     2  source_row     u16  first row copied
//       14     2  rows           u16  >= 1; source_row + rows <= kMaxPrefixBlockTokens (the
//                                     rank checks against its block size, and that a restore's
//                                     segments' rows add up to it)
//
//   PrefixNextUse record (16 bytes; no two with the same memory_rank and block_hash): a block in
//   the rank's KV tiers (demoted) that a waiting request will reuse, for the tiers' eviction order
//   (memory_node/tier_eviction_order.h). The list replaces the previous plan's.
//        0     8  block_hash     u64  not 0
//        8     4  next_use       i32  >= 0: queue position of the first waiting request that will
//                                     reuse it (0: the head of the queue)
//       12     2  memory_rank    u16
//       14     2  reserved       must be 0
//
// Restore reply body (memory rank -> compute rank 0, once per plan with restores for the rank,
// sent when the plan is applied; body_bytes = 16 + 8 * failed_count):
//
//   offset  size  field         notes
//        0     8  step_id       u64  the plan's
//        8     2  memory_rank   u16
//       10     2  reserved      must be 0
//       12     4  failed_count  u32
//       16   8*n  failed        u64 each: restores that found no good copy (not registered); the
//                               controller forgets them and the requests waiting for them compute
//                               those tokens
//
// Layer message header body (48 bytes; a whole frame is 64 bytes):
//
//   offset  size  field           notes
//   ------  ----  --------------  --------------------------------------------------------------
//        0     8  step_id         u64
//        8     8  seqno           u64  doorbell sequence number of this message
//       16     8  payload_bytes   u64  == rows * row_bytes (computed in 64 bits: cannot overflow)
//       24     4  layer           u32
//       28     4  rows            u32
//       32     4  row_bytes       u32  a multiple of DTypeSize(dtype)
//       36     4  payload_crc32c  u32  Crc32c() of the payload that follows the frame
//       40     1  kind            u8   LayerMessageKind: 1 (kQkv), 2 (kAttnOut), 3 (kResidual),
//                                      4 (kQ), 5 (kKv)
//       41     1  dtype           u8   tandem::DType: 0 (f32), 1 (f16), 2 (bf16)
//       42     6  reserved        must be 0
//
// Hello body (compute rank -> memory rank, the first message on a connection; 112 bytes, a whole
// frame is 128 bytes; f64 values travel as their IEEE-754 binary64 bit pattern):
//
//   offset  size  field                  notes
//   ------  ----  ---------------------  -------------------------------------------------------
//        0     8  kv_capacity_tokens     u64  0: the memory rank sizes its KV pool from its
//                                             memory; else that many slots, <= 2^31-1
//        8     4  num_layers             u32  >= 1
//       12     4  num_heads              u32  >= 1
//       16     4  num_kv_heads           u32  >= 1, divides num_heads
//       20     4  head_dim               u32  in [1, 1024]
//       24     4  max_tokens_per_step    u32  >= 1: rows of one step at most
//       28     4  max_requests_per_step  u32  in [1, max_tokens_per_step]
//       32     4  max_position           u32  >= 1: the model's context length
//       36     4  kv_memory_fraction     f32  in (0, 1]
//       40     4  attn_out_buffer        u32  id of the compute rank's buffer where this memory
//                                             rank writes attention outputs
//       44     2  memory_rank            u16  the receiver's index in the deployment,
//                                             < num_memory_ranks
//       46     2  num_memory_ranks       u16  >= 1
//       48     1  dtype                  u8   tandem::DType of activations on the wire: 0, 1, 2
//       49     1  checksums              u8   0 or 1: layer payload crcs are computed and checked
//       50     2  prefix_block_tokens    u16  0: no prefix registry; else in [1, 4096], tokens per
//                                             registered prefix block
//       52     1  prefix_sharing         u8   PrefixSharing: 0 (off), 1 (on), 2 (auto); 1 and 2
//                                             need prefix_block_tokens >= 1
//       53     1  partition              u8   AttentionPartition (common/head_partition.h):
//                                             0 (request), 1 (head)
//       54     1  lanes                  u8   in [1, kMaxMicroBatches]: micro-batches in flight
//                                             at once (pipeline.batches); lane j receives into
//                                             the reply's qkv_buffer + j and writes its outputs
//                                             to attn_out_buffer + j
//       55     1  compute_ranks          u8   in [1, lanes]: compute ranks of the deployment
//                                             (compute.ranks); lane j belongs to compute rank
//                                             j % compute_ranks, whose connection carries its
//                                             q,k,v and outputs. Compute ranks other than 0 connect
//                                             with a compute hello (below)
//       56     4  kv_head_begin          u32  the KV heads this memory rank holds of every
//       60     4  kv_head_end            u32  request it serves, [kv_head_begin, kv_head_end):
//                                             request partition: [0, num_kv_heads); head
//                                             partition: num_kv_heads >= num_memory_ranks
//                                             and a non-empty range within
//                                             [0, num_kv_heads) ([m·Hkv/M, (m+1)·Hkv/M) for
//                                             m = memory_rank at start; slice i of k after a
//                                             re-partition over k surviving ranks). A memory rank
//                                             serving the head partition takes a later hello
//                                             between steps as a re-partition: its KV is dropped
//                                             and set up again for the new slice (new reply)
//       64     2  slice_layers           u16  0: lane j stays on compute rank j % compute_ranks;
//                                             else pipeline.mode rotational, in [1, num_layers]
//                                             with compute_ranks >= 2: lane j's output of layer l
//                                             goes to compute rank (j + l / slice_layers) %
//                                             compute_ranks (common/pipeline_schedule.h)
//       66     1  q_first                u8   0 or 1: pipeline.q_first: each layer's rows come
//                                             as two messages into the lane's receive buffer, q
//                                             (kind 4) at offset 0 with seqno s, then k,v (kind 5)
//                                             at QFirstKvOffset (common/layer_message.h) with
//                                             seqno s + 1; the output carries seqno s + 1
//       67     1  rope_type              u8   RopeType (common/model_spec.h): 0 (default),
//                                             1 (llama3)
//       68     1  compute_mask           u8   the compute ranks that run lanes and connect to
//                                             this rank (bit c: compute rank c): bit 0 set, no
//                                             bit at or above compute_ranks; at start-up every
//                                             one. A memory rank that rejoins while some were
//                                             given up gets the ones that go on: it waits for
//                                             their compute hellos only, and they are, in rank
//                                             order, the pipeline's compute ranks 0, 1, ... (as
//                                             after a step discard with this mask)
//       69     3  reserved               must be 0
//       72     8  rope_theta             f64  finite, > 0 (the model's rotary embedding, with
//       80     8  rope_factor            f64  which a memory rank turns restored keys to new
//       88     8  rope_low_freq_factor   f64  positions: kv.store_pre_rope); the three factors
//       96     8  rope_high_freq_factor  f64  finite, > 0
//      104     8  rope_original_max_position
//                                        u64  >= 1, <= 2^31-1
//
// Hello reply body (memory rank -> compute rank; body_bytes = 18 + device_bytes;
// kv_capacity_tokens counts tokens of the rank's KV head slice, which under the head partition
// is a slice of every request's KV):
//
//   offset  size  field               notes
//   ------  ----  ------------------  ----------------------------------------------------------
//        0     8  kv_capacity_tokens  u64  KV slots of the memory rank, in [1, 2^31-1]
//        8     4  qkv_buffer          u32  id of the memory rank's buffer receiving q, k, v rows
//       12     2  memory_rank         u16
//       14     1  dtype               u8   tandem::DType the memory rank computes in: 0, 1, 2
//       15     1  persisted           u8   0 or 1: kv.tiers.persist is on at this rank, whose
//                                          persisted blocks reports (below) follow the reply on
//                                          compute rank 0's connection; compute replicas ignore it
//       16     2  device_bytes        u16  <= 256
//       18     n  device              device_bytes bytes of UTF-8 text (not checked to be UTF-8),
//                                     no NUL byte, e.g. "cuda:0 (NVIDIA H200)"
//
// Release body (compute rank -> memory rank: requests that ended or were cancelled, whose KV the
// memory rank frees; body_bytes = 16 + 8 * request_count):
//
//   offset  size  field          notes
//   ------  ----  -------------  ---------------------------------------------------------------
//        0     8  step_id        u64  the last step that involved them
//        8     4  request_count  u32
//       12     4  reserved       must be 0
//       16   8*n  request_ids    u64 each, no duplicates
//
// Error body (either way: the sender stops because of this error; body_bytes = 8 +
// message_bytes):
//
//   offset  size  field          notes
//   ------  ----  -------------  ---------------------------------------------------------------
//        0     4  code           u32  absl::StatusCode value in [1, 16]
//        4     4  message_bytes  u32  <= 65536
//        8     n  message        message_bytes bytes, any except NUL
//
// Bye body (compute rank -> memory rank: clean shutdown; 8 bytes):
//
//   offset  size  field  notes
//   ------  ----  -----  ----------------------------------------------------------------------
//        0     8  steps  u64  steps the compute rank ran (informational)
//
// Stats request body (compute rank -> memory rank, between steps; 8 bytes):
//
//   offset  size  field   notes
//   ------  ----  ------  ---------------------------------------------------------------------
//        0     8  cookie  u64  echoed by the reply
//
// Memory stats body (memory rank -> compute rank: the reply; 32 bytes): totals since the rank
// started, for the pipeline report (docs/architecture.md, "A measured pipeline"):
//
//   offset  size  field         notes
//   ------  ----  ------------  ----------------------------------------------------------------
//        0     8  cookie        u64  the request's
//        8     2  memory_rank   u16
//       10     6  reserved      must be 0
//       16     8  steps         u64  steps that had rows on this rank
//       24     8  attention_ns  u64  time in attention (KV append and attention of every layer):
//                                    device time on a GPU, host time on the CPU; the rest of each
//                                    step of compute rank 0 the rank waits
//
// Heartbeat body (compute rank 0 -> memory rank or compute replica, while the deployment is idle;
// 16 bytes):
//
//   offset  size  field       notes
//   ------  ----  ----------  --------------------------------------------------------------------
//        0     8  seq         u64  echoed by the reply
//        8     4  silence_ms  u32  in [1, kMaxHeartbeatSilenceMs]: from now on the receiver
//                                  stops (with an error naming compute rank 0) once it has heard
//                                  nothing from compute rank 0 for this long; each heartbeat sets
//                                  it anew
//       12     4  reserved    must be 0
//
// Heartbeat reply body (memory rank or compute replica -> compute rank 0, at once; 16 bytes):
//
//   offset  size  field        notes
//   ------  ----  -----------  -------------------------------------------------------------------
//        0     8  seq          u64  the heartbeat's
//        8     2  memory_rank  u16  the memory rank's index; a compute replica's compute rank
//       10     6  reserved     must be 0
//
// Step discard body (compute rank 0 -> memory ranks and compute replicas, when a compute replica
// was lost, or a memory rank while replicas run; 24 bytes, then 2 per lost memory rank;
// docs/architecture.md, "Failures"):
//
//   offset  size  field          notes
//   ------  ----  -------------  -------------------------------------------------------------------
//        0     8  step_id        u64  the step in flight to drop and run again from layer 0 with the
//                                     plans already applied (KV slots, prefix blocks and restores
//                                     stay as the plans left them; the rerun writes the same new
//                                     slots again); 0: no step in flight (a loss found while idle)
//        8     8  seqno_base     u64  >= 1: every lane's doorbell seqno (q,k,v, outputs, residual
//                                     streams) starts again from here, on every rank, above any
//                                     seqno written so far
//       16     1  compute_mask   u8   bit c set: compute rank c goes on; bit 0 (compute rank 0)
//                                     always set, no bit at or above the hello's compute_ranks. The
//                                     survivors, in rank order, are the pipeline's compute ranks
//                                     0, 1, ... from now on (common/pipeline_schedule.h with their
//                                     count; one left: every lane on compute rank 0). A replica
//                                     whose bit is clear is released (it stops, exit status 0); one
//                                     whose bit is set goes on as its place among the survivors and
//                                     answers with a compute hello (as at start-up) once it has
//                                     applied the discard
//       17     1  drop           u8   0 or 1: 1: the step is dropped, not run again (the head
//                                     partition, where a lost memory rank held KV heads of every
//                                     request: the heads are split again next); version 13
//       18     2  lost_count     u16  how many memory ranks follow
//       20     4  reserved       must be 0
//       24  2·n   lost_memory    u16 each, strictly ascending: every memory rank compute rank 0
//                                     has given up so far; a replica that goes on sends them
//                                     nothing and awaits nothing from them (a memory rank ignores
//                                     the list)
//
// Memory rejoin body (compute rank 0 -> compute replica, then the replica's answer back; a memory
// rank given up while replicas run rejoins: docs/architecture.md, "Failures"; body_bytes = 16 +
// text_bytes):
//
//   offset  size  field            notes
//   ------  ----  ---------------  -------------------------------------------------------------
//        0     2  memory_rank      u16  the rank that rejoins
//        2     1  answer           u8   0: compute rank 0's request: connect to the rank's new
//                                       process at `text` (its address) with a compute hello,
//                                       take its hello reply and its outputs in buffers
//                                       attn_out_buffer + lane; 1: the replica's answer, `text`
//                                       empty once it is connected (the rank is live for it from
//                                       then on), else why not (it stays lost)
//        3     1  reserved         must be 0
//        4     4  attn_out_buffer  u32  the compute ranks' buffer id of lane 0 of the rank's
//                                       attention outputs (the hello's, fresh ids)
//        8     2  text_bytes       u16  <= 1024; a request's is not 0
//       10     6  reserved         must be 0
//       16     n  text             text_bytes bytes, no NUL
//
// Head split body (compute rank 0 -> compute replica under the head partition, then the replica's
// answer back: the live memory ranks split the KV heads again after a loss or a rejoin,
// ComputeRank::RepartitionHeads; body_bytes = 16 + 12 * rank_count + text_bytes):
//
//   offset  size  field            notes
//   ------  ----  ---------------  -------------------------------------------------------------
//        0     8  split            u64  not 0: which split (the answer names it)
//        8     1  answer           u8   0: compute rank 0's request: memory rank ranks[i] holds
//                                       KV head slice i of rank_count (common/head_partition.h),
//                                       takes its q,k,v in its buffers qkv_buffer + lane and
//                                       writes its outputs to buffers attn_out_buffer + lane;
//                                       every memory rank not listed is lost; 1: the replica's
//                                       answer, `text` empty once its buffers are set up, else why
//                                       not
//        9     1  reserved         must be 0
//       10     2  rank_count       u16  a request's >= 1, an answer's 0
//       12     2  text_bytes       u16  <= 1024; a request's 0
//       14     2  reserved         must be 0
//       16  12·n  ranks            rank_count records, strictly ascending memory_rank:
//                                    0  2  memory_rank      u16
//                                    2  2  reserved         must be 0
//                                    4  4  attn_out_buffer  u32  lane 0's id on every compute rank
//                                    8  4  qkv_buffer       u32  the rank's lane 0 receive buffer
//     16+12n  n  text             text_bytes bytes, no NUL
//
// Persisted blocks report body (memory rank -> compute rank 0, right after the hello reply when
// its `persisted` byte is 1: the blocks the rank's disk tier found at start, with their tokens,
// parents before children, in one or more reports, the last one marked; a rank that found none
// sends one empty report; body_bytes <= kMaxPersistedBlocksBodyBytes, 1 MiB):
//
//   offset  size  field         notes
//   ------  ----  ------------  ----------------------------------------------------------------
//        0     2  memory_rank   u16
//        2     1  last          u8   0 or 1: this is the rank's last report
//        3     1  reserved      must be 0
//        4     4  block_count   u32
//        8        blocks        block_count records, each 24 + 4 * token_count bytes:
//                                 0  8  hash         u64  not 0
//                                 8  8  parent_hash  u64  0 exactly when depth is 1
//                                16  4  depth        i32  >= 1: the block's place in its chain
//                                20  4  token_count  u32  in [1, kMaxPrefixBlockTokens]
//                                24     tokens       token_count i32
//                               the body ends after the last record
//
// Decoders trust nothing: they never read past the span, check every length before reading,
// bound counts and lengths by the body length before allocating, and check every field's range.
// Errors (messages start with the format's name: "step plan: ", "layer message header: ",
// "hello: ", "hello reply: ", "release: ", "error message: ", "bye: ", "stats request: ",
// "memory stats: ", "heartbeat: ", "heartbeat reply: ", "step discard: ", "persisted blocks: ", and name the
// field with its record ("request 3: ", "group 0: ", "publish 1: ", "eviction 2: ") or byte offset):
//   DataLoss         the span is shorter than the frame or the body shorter than its contents
//                    claim (truncation; checked before the range of a count or length), or a crc
//                    mismatch
//   InvalidArgument  wrong magic, a version older than kWireVersion (0 included), wrong header_bytes, a field
//   out of range, a reserved
//                    byte not 0, body bytes left after the contents, or bytes after the frame (the
//                    span must hold exactly one frame)
//   Unimplemented    a version newer than kWireVersion
//
// Thread safety: all functions are pure and may be called concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/head_partition.h"
#include "common/model_spec.h"
#include "common/top_logprobs.h"

namespace tandem {

inline constexpr uint16_t kWireVersion = 13;
inline constexpr uint32_t kStepPlanMagic = 0x50534454;      // "TDSP" on the wire
inline constexpr uint32_t kLayerMessageMagic = 0x4d4c4454;  // "TDLM" on the wire
inline constexpr size_t kFrameHeaderBytes = 16;
inline constexpr size_t kStepPlanFixedBytes = 32;           // step plan body before the requests
inline constexpr size_t kStepRequestBytes = 64;             // one StepRequest record
inline constexpr size_t kPrefixGroupBytes = 24;             // one PrefixGroup record
inline constexpr size_t kPrefixPublishBytes = 32;           // one PrefixPublish record
inline constexpr size_t kPrefixEvictBytes = 16;             // one PrefixEvict record
inline constexpr size_t kPrefixRestoreBytes = 24;           // one PrefixRestore record
inline constexpr size_t kPrefixNextUseBytes = 16;           // one PrefixNextUse record
inline constexpr size_t kPrefixSegmentBytes = 16;           // one PrefixSegment record
inline constexpr size_t kMaxPrefixSegments = 16;            // PrefixSegment records of one restore
inline constexpr size_t kMaxPrefixNextUses = 2048;          // PrefixNextUse records in one plan
inline constexpr uint32_t kRestoreReplyMagic = 0x54524454;  // "TDRT" on the wire
inline constexpr size_t kRestoreReplyFixedBytes = 16;       // restore reply body before the hashes
inline constexpr size_t kLayerMessageBodyBytes = 48;        // layer message header body

// Control messages.
inline constexpr uint32_t kHelloMagic = 0x49484454;            // "TDHI" on the wire
inline constexpr uint32_t kHelloReplyMagic = 0x52484454;       // "TDHR" on the wire
inline constexpr uint32_t kReleaseMagic = 0x4c524454;          // "TDRL" on the wire
inline constexpr uint32_t kErrorMagic = 0x52454454;            // "TDER" on the wire
inline constexpr uint32_t kByeMagic = 0x59424454;              // "TDBY" on the wire
inline constexpr uint32_t kStatsRequestMagic = 0x51534454;     // "TDSQ" on the wire
inline constexpr uint32_t kMemoryStatsMagic = 0x534d4454;      // "TDMS" on the wire
inline constexpr uint32_t kComputeHelloMagic = 0x48434454;     // "TDCH" on the wire
inline constexpr uint32_t kReplicaStepMagic = 0x53524454;      // "TDRS" on the wire
inline constexpr uint32_t kReplicaResultMagic = 0x52524454;    // "TDRR" on the wire
inline constexpr size_t kComputeHelloBodyBytes = 8;            // compute hello body
inline constexpr size_t kReplicaStepFixedBytes = 8;            // replica step body before the tokens
inline constexpr size_t kReplicaResultFixedBytes = 16;         // replica result body before the tokens
inline constexpr size_t kMaxMicroBatches = 8;                  // pipeline.batches at most
inline constexpr size_t kHelloBodyBytes = 112;                 // hello body
inline constexpr size_t kHelloReplyFixedBytes = 18;            // hello reply body before the device
inline constexpr size_t kReleaseFixedBytes = 16;               // release body before the request ids
inline constexpr size_t kErrorFixedBytes = 8;                  // error body before the message
inline constexpr size_t kByeBodyBytes = 8;                     // bye body
inline constexpr size_t kStatsRequestBodyBytes = 8;            // stats request body
inline constexpr size_t kMemoryStatsBodyBytes = 32;            // memory stats body
inline constexpr uint32_t kReplicaRingMagic = 0x47524454;      // "TDRG" on the wire
inline constexpr size_t kReplicaRingFixedBytes = 8;            // replica ring body before the address
inline constexpr size_t kMaxAddressBytes = 1024;               // ReplicaRingMessage::next_address
inline constexpr uint32_t kHeartbeatMagic = 0x42484454;        // "TDHB" on the wire
inline constexpr uint32_t kHeartbeatReplyMagic = 0x41484454;   // "TDHA" on the wire
inline constexpr size_t kHeartbeatBodyBytes = 16;              // heartbeat and heartbeat reply bodies
inline constexpr uint32_t kStepDiscardMagic = 0x44534454;      // "TDSD" on the wire
inline constexpr size_t kStepDiscardFixedBytes = 24;           // step discard body before the lost ranks
inline constexpr uint32_t kPersistedBlocksMagic = 0x42504454;  // "TDPB" on the wire
inline constexpr size_t kPersistedBlocksFixedBytes = 8;        // persisted blocks body before the blocks
inline constexpr size_t kPersistedBlockFixedBytes = 24;        // one block record before its tokens
inline constexpr uint32_t kMemoryRejoinMagic = 0x4a4d4454;     // "TDMJ" on the wire
inline constexpr size_t kMemoryRejoinFixedBytes = 16;          // memory rejoin body before its text
inline constexpr uint32_t kHeadSplitMagic = 0x53484454;        // "TDHS" on the wire
inline constexpr size_t kHeadSplitFixedBytes = 16;             // head split body before its records
inline constexpr size_t kHeadSplitRankBytes = 12;              // one head split rank record
inline constexpr size_t kMaxPersistedBlocksBodyBytes = size_t{1} << 20;      // one report's body at most
inline constexpr uint32_t kMaxHeartbeatSilenceMs = (uint32_t{1} << 31) - 1;  // about 24.8 days
inline constexpr uint32_t kMaxHeadDim = 1024;
inline constexpr uint16_t kMaxPrefixBlockTokens = 4096;  // HelloMessage::prefix_block_tokens
inline constexpr uint64_t kMaxKvCapacityTokens = (uint64_t{1} << 31) - 1;
inline constexpr size_t kMaxDeviceBytes = 256;          // HelloReplyMessage::device
inline constexpr size_t kMaxErrorMessageBytes = 65536;  // ErrorMessage::message

// One request's share of a step.
struct StepRequest {
  uint64_t request_id = 0;
  uint16_t memory_rank = 0;  // rank that owns the request's KV cache
  // -1: none; else index into StepPlan::groups (the deepest group), of the same memory_rank.
  int32_t prefix_group = -1;
  // A request's first step with position > 0 may attach registered prefix blocks: the chain that
  // ends at the block with this hash, which covers exactly `position` tokens. 0: the step attaches
  // nothing (always so when position is 0).
  uint64_t attach_hash = 0;
  int32_t position = 0;  // first position of this step's rows, >= 0
  int32_t q_len = 1;     // rows in this step, >= 1
  int32_t kv_len = 1;    // context length after this step, >= position + q_len
  bool sample = false;   // the last row produces a token
  // Sampling parameters (meaningful when `sample`, validated always).
  float temperature = 0.0f;  // finite, >= 0; 0 is greedy
  int32_t top_k = 0;         // >= 0; 0 is no top-k cut
  float top_p = 1.0f;        // in (0, 1]
  uint64_t seed = 0;
  uint64_t counter = 0;
  // Top log-probability alternatives the sampled token reports, <= kMaxTopLogprobs (a compute
  // replica computes them; memory ranks ignore it).
  uint8_t top_logprobs = 0;

  friend bool operator==(const StepRequest&, const StepRequest&) = default;
};

// A prefix group (docs/architecture.md, "KV cache on a memory rank"): requests of one memory rank whose
// contexts start with the same registered blocks. Its prefix is the chain of registered blocks
// ending at `block_hash` (prefix_tokens tokens); a nested group's parent is an earlier group of the
// same rank whose prefix is a proper prefix of this one's.
struct PrefixGroup {
  uint64_t block_hash = 0;
  int32_t prefix_tokens = 0;  // >= 1; more than the parent's
  int32_t parent = -1;        // -1: none; else < this group's index, a group of the same memory_rank
  uint16_t memory_rank = 0;

  friend bool operator==(const PrefixGroup&, const PrefixGroup&) = default;
};

// Registers block `block_index` of a request's context (positions [block_index * B, (block_index +
// 1) * B) for the rank's block size B) under `block_hash`, as the child of the block `parent_hash`
// (0 when block_index is 0). The request appears in the same plan, with the same memory_rank; no two
// publishes of a plan register the same (memory_rank, block_hash).
struct PrefixPublish {
  uint64_t request_id = 0;
  uint64_t block_hash = 0;
  uint64_t parent_hash = 0;  // 0 when block_index is 0
  int32_t block_index = 0;   // >= 0
  uint16_t memory_rank = 0;

  friend bool operator==(const PrefixPublish&, const PrefixPublish&) = default;
};

// Drops a registered block (leaves first, never one a live request uses). No two evictions of a plan
// name the same (memory_rank, block_hash).
struct PrefixEvict {
  uint64_t block_hash = 0;
  uint16_t memory_rank = 0;
  // Empty, or the block's tokens (at most kMaxPrefixBlockTokens): with kv.tiers.persist the
  // controller sends them, so that the rank's block file can be registered again after a restart.
  std::vector<int32_t> tokens;

  friend bool operator==(const PrefixEvict&, const PrefixEvict&) = default;
};

// Brings a block the controller evicted from a rank's KV pool back from the rank's KV tiers: the rank
// loads it into free slots and registers it (or reports it failed in its restore reply). Requests
// attach restored blocks from the next plan on.
// kv.store_pre_rope: rows of a block registered on a rank (in its KV pool or its KV tiers) that a
// shifted restore copies into a new block at other positions.
struct PrefixSegment {
  uint64_t source_hash = 0;  // not 0: the registered block the rows come from
  int32_t source_index = 0;  // >= 0: its block_index (its row r holds position source_index * B + r)
  uint16_t source_row = 0;   // first row copied
  uint16_t rows = 1;         // >= 1; source_row + rows <= B

  friend bool operator==(const PrefixSegment&, const PrefixSegment&) = default;
};

struct PrefixRestore {
  uint64_t block_hash = 0;
  uint64_t parent_hash = 0;  // 0 when block_index is 0
  int32_t block_index = 0;   // >= 0
  uint16_t memory_rank = 0;
  // Empty: the block's own KV comes back from the rank's tiers. Else (kv.store_pre_rope) the block
  // is assembled: the segments' rows, in order, are its B rows (their rows add up to B), each key
  // turned from its source position to its new one (block_index * B + row; AttentionExecutor::
  // RotateKeys). A segment's source is registered on the rank before the plan's restores are
  // applied, or restored earlier in the same plan.
  std::vector<PrefixSegment> segments;

  friend bool operator==(const PrefixRestore&, const PrefixRestore&) = default;
};

// A block of a rank's KV tiers that a waiting request will reuse (KV tiers' next-use eviction):
// `next_use` is the queue position of the first waiting request that will. A plan's list (at most
// kMaxPrefixNextUses records, all in micro-batch 0) replaces the previous plan's; no two name the
// same (memory_rank, block_hash).
struct PrefixNextUse {
  uint64_t block_hash = 0;
  int32_t next_use = 0;  // >= 0
  uint16_t memory_rank = 0;

  friend bool operator==(const PrefixNextUse&, const PrefixNextUse&) = default;
};

// Sent once per step by the controller to every rank. A memory rank applies it in this order:
// next uses (handed to its KV tiers), evictions (saved to the rank's KV tiers when it has them),
// restores, requests (attach and new slots), publishes; then it resolves the groups.
struct StepPlan {
  uint64_t step_id = 0;
  // Pipelining (pipeline.batches): the step is split into `micro_batches` plans, this one is
  // number `micro_batch`; 0 of 1 otherwise.
  uint8_t micro_batch = 0;
  uint8_t micro_batches = 1;
  std::vector<StepRequest> requests;
  std::vector<PrefixGroup> groups;
  std::vector<PrefixPublish> publishes;
  std::vector<PrefixEvict> evictions;
  std::vector<PrefixRestore> restores;
  std::vector<PrefixNextUse> next_uses;

  friend bool operator==(const StepPlan&, const StepPlan&) = default;
};

// kv.prefix_sharing: whether attention reads a group's shared prefix once for all its rows.
enum class PrefixSharing : uint8_t { kOff = 0, kOn = 1, kAuto = 2 };

// kResidual: a compute rank hands a micro-batch's residual stream to the next compute rank
// (pipeline.mode rotational; common/pipeline_schedule.h), host-staged path. kQ and kKv:
// pipeline.q_first splits a layer's kQkv rows into the q columns of every row (rows, q width),
// sent first, and the k and v columns (rows, 2 × kv width) after them.
enum class LayerMessageKind : uint8_t { kQkv = 1, kAttnOut = 2, kResidual = 3, kQ = 4, kKv = 5 };

// Precedes each per-layer payload between compute and memory ranks.
struct LayerMessageHeader {
  uint64_t step_id = 0;
  uint32_t layer = 0;
  LayerMessageKind kind = LayerMessageKind::kQkv;
  DType dtype = DType::kF32;
  uint32_t rows = 0;
  uint32_t row_bytes = 0;  // a multiple of DTypeSize(dtype)
  uint64_t seqno = 0;
  uint64_t payload_bytes = 0;  // == rows * row_bytes
  uint32_t payload_crc32c = 0;

  friend bool operator==(const LayerMessageHeader&, const LayerMessageHeader&) = default;
};

// Compute rank -> memory rank, the first message on a connection.
struct HelloMessage {
  uint16_t memory_rank = 0;            // the receiver's index in the deployment, < num_memory_ranks
  uint16_t num_memory_ranks = 1;       // >= 1
  uint32_t num_layers = 1;             // >= 1
  uint32_t num_heads = 1;              // >= 1
  uint32_t num_kv_heads = 1;           // >= 1, divides num_heads
  uint32_t head_dim = 1;               // in [1, kMaxHeadDim]
  uint32_t max_tokens_per_step = 1;    // >= 1: rows of one step at most
  uint32_t max_requests_per_step = 1;  // in [1, max_tokens_per_step]
  uint32_t max_position = 1;           // >= 1: the model's context length
  DType dtype = DType::kF32;           // activation element type on the wire
  uint64_t kv_capacity_tokens = 0;     // 0: sized from memory; else slots, <= kMaxKvCapacityTokens
  float kv_memory_fraction = 1.0f;     // in (0, 1]
  uint32_t attn_out_buffer = 0;        // compute rank's buffer for this rank's attention outputs
  bool checksums = false;              // layer payload crcs are computed and checked
  uint16_t prefix_block_tokens = 0;    // tokens per prefix block, <= kMaxPrefixBlockTokens; 0: no
                                       // prefix registry
  uint8_t prefix_sharing = 0;          // PrefixSharing: 0 off, 1 on, 2 auto; not off needs a registry
  // How attention is split over the memory ranks, and the KV heads [kv_head_begin, kv_head_end)
  // this rank holds of each of its requests: all of them under the request partition, its slice
  // under the head partition (HeadSlice::kv_head_begin/end: any non-empty range of the heads, a
  // re-partition's slices may differ in size); any other value is refused.
  AttentionPartition partition = AttentionPartition::kRequest;
  uint32_t kv_head_begin = 0;
  uint32_t kv_head_end = 1;
  // Micro-batches the compute rank keeps in flight (pipeline.batches; 1 without pipelining): the
  // memory rank gives each a receive buffer (qkv_buffer + lane) and writes its outputs to
  // attn_out_buffer + lane.
  uint8_t lanes = 1;
  uint8_t compute_ranks = 1;  // compute.ranks; lane j belongs to compute rank j % compute_ranks
  // The compute ranks that go on (bit c: compute rank c; bit 0 always set): at start-up every one;
  // a rank that rejoins after some were given up waits for these only, and they are the pipeline's
  // compute ranks 0, 1, ... in rank order.
  uint8_t compute_mask = 1;
  // pipeline.mode rotational: layers per slice (common/pipeline_schedule.h); 0: fixed (each lane
  // stays on compute rank j % compute_ranks).
  uint16_t slice_layers = 0;
  // pipeline.q_first: each layer's q rows come first (kind kQ) and its k,v rows after (kind kKv),
  // so that the memory rank runs attention over the existing context while k,v are in flight.
  bool q_first = false;
  // The model's rotary embedding (kv.store_pre_rope: a memory rank turns restored keys to new
  // positions with it; common/model_spec.h).
  RopeSpec rope;

  friend bool operator==(const HelloMessage&, const HelloMessage&) = default;
};

// Memory rank -> compute rank, the answer to a hello.
struct HelloReplyMessage {
  uint16_t memory_rank = 0;
  DType dtype = DType::kF32;        // what the memory rank computes in; equals the hello's
  uint64_t kv_capacity_tokens = 1;  // in [1, kMaxKvCapacityTokens]
  uint32_t qkv_buffer = 0;          // memory rank's buffer receiving q, k, v rows
  std::string device;               // UTF-8, <= kMaxDeviceBytes bytes, no NUL; "cuda:0 (NVIDIA H200)"
  // kv.tiers.persist is on at the rank: its persisted blocks reports follow on compute rank 0's
  // connection.
  bool persisted = false;

  friend bool operator==(const HelloReplyMessage&, const HelloReplyMessage&) = default;
};

// Compute rank -> memory rank: requests that ended or were cancelled; the memory rank frees their
// KV.
struct ReleaseMessage {
  uint64_t step_id = 0;               // the last step that involved them
  std::vector<uint64_t> request_ids;  // no duplicates

  friend bool operator==(const ReleaseMessage&, const ReleaseMessage&) = default;
};

// Either way: the sender is stopping because of this error.
struct ErrorMessage {
  uint32_t code = 2;    // absl::StatusCode value in [1, 16]
  std::string message;  // <= kMaxErrorMessageBytes bytes, any except NUL

  friend bool operator==(const ErrorMessage&, const ErrorMessage&) = default;
};

// Compute rank -> memory rank: clean shutdown.
struct ByeMessage {
  uint64_t steps = 0;  // steps the compute rank ran (informational)

  friend bool operator==(const ByeMessage&, const ByeMessage&) = default;
};

// Compute replicas (compute.ranks > 1, pipeline.mode fixed; docs/architecture.md, "Compute
// replicas"). Bodies:
//   compute hello (8 bytes): u16 compute_rank at 0 (in [1, compute_ranks)), u16 compute_ranks at 2
//     (in [2, kMaxMicroBatches]), 4 reserved bytes (0).
//   replica step: u32 token_count at 0, 4 reserved bytes (0), token_count i32 input tokens at 8,
//     then a whole step plan frame (header included) that fills the rest of the body; token_count
//     equals the plan's rows (the sum of its requests' q_len).
//   replica result: u64 step_id at 0, u8 micro_batch at 8, u8 has_top at 9 (0 or 1), 2 reserved
//     bytes (0), u32 count at 12, then count i32 tokens and count f32 log-probabilities; with
//     has_top, then count u8 alternative counts (each in [0, kMaxTopLogprobs]), then for each token
//     in order its alternatives, each an i32 token (>= 0) and an f32 log-probability. The body ends
//     exactly there.

// Compute replica -> memory rank, the first message on its connection (the memory rank answers
// with a hello reply once compute rank 0's hello has set it up), and -> compute rank 0 once the
// replica is connected to every memory rank.
struct ComputeHelloMessage {
  uint16_t compute_rank = 1;
  uint16_t compute_ranks = 2;

  friend bool operator==(const ComputeHelloMessage&, const ComputeHelloMessage&) = default;
};

// Compute rank 0 -> compute replica r, once every replica is ready (pipeline.mode rotational with
// 3 or more compute ranks): r connects to next_address (compute rank r + 1's; empty for the last
// replica, whose successor is compute rank 0) with a compute hello, accepts its predecessor's
// connection (r >= 2), then says hello to compute rank 0 again. Also right after a step discard
// that keeps r and makes its successor in the ring (the next compute rank of the discard's mask)
// another replica than before: next_address is that replica's, and r connects to it with a
// compute hello before it answers the discard (the successor, which works out from the mask that
// its predecessor changed, accepts the connection). Body: u16 address_bytes at 0
// (<= kMaxAddressBytes), 6 reserved bytes (0), then the address (no NUL); the body ends there.
struct ReplicaRingMessage {
  std::string next_address;

  friend bool operator==(const ReplicaRingMessage&, const ReplicaRingMessage&) = default;
};

// Compute rank 0 -> a compute replica: one micro-batch of a step (its plan, with micro_batch and
// micro_batches set) and the input token of each of its rows, in plan order.
struct ReplicaStepMessage {
  StepPlan plan;
  std::vector<int32_t> tokens;

  friend bool operator==(const ReplicaStepMessage&, const ReplicaStepMessage&) = default;
};

// Compute replica -> compute rank 0: the tokens sampled for one micro-batch (one per sampled
// request, in plan order), their log-probabilities and, when a request asked, their top
// alternatives.
struct ReplicaResultMessage {
  uint64_t step_id = 0;
  uint8_t micro_batch = 0;
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  // Empty (has_top 0), or one list per token (has_top 1; a list may be empty).
  std::vector<std::vector<TopLogprob>> top;

  friend bool operator==(const ReplicaResultMessage&, const ReplicaResultMessage&) = default;
};

// Memory rank -> compute rank 0: the outcome of a plan's restores for this rank.
struct RestoreReplyMessage {
  uint64_t step_id = 0;
  uint16_t memory_rank = 0;
  std::vector<uint64_t> failed;  // restores that were not registered

  friend bool operator==(const RestoreReplyMessage&, const RestoreReplyMessage&) = default;
};

// Compute rank -> memory rank, between steps: send your totals (a MemoryStatsMessage).
struct StatsRequestMessage {
  uint64_t cookie = 0;

  friend bool operator==(const StatsRequestMessage&, const StatsRequestMessage&) = default;
};

// Memory rank -> compute rank: its totals since it started (see the body layout above).
struct MemoryStatsMessage {
  uint64_t cookie = 0;
  uint16_t memory_rank = 0;
  uint64_t steps = 0;
  uint64_t attention_ns = 0;

  friend bool operator==(const MemoryStatsMessage&, const MemoryStatsMessage&) = default;
};

// Compute rank 0 -> memory rank or compute replica while the deployment is idle
// (launch.heartbeat_s): answer with a heartbeat reply; and stop once compute rank 0 has been silent
// for silence_ms (see the body layout above).
struct HeartbeatMessage {
  uint64_t seq = 0;
  uint32_t silence_ms = 1;  // in [1, kMaxHeartbeatSilenceMs]

  friend bool operator==(const HeartbeatMessage&, const HeartbeatMessage&) = default;
};

// Memory rank or compute replica -> compute rank 0: the answer to a heartbeat.
struct HeartbeatReplyMessage {
  uint64_t seq = 0;
  uint16_t memory_rank = 0;  // a compute replica puts its compute rank here

  friend bool operator==(const HeartbeatReplyMessage&, const HeartbeatReplyMessage&) = default;
};

// Compute rank 0 -> memory ranks and compute replicas: a compute replica is lost, or a memory rank
// while replicas run; drop step `step_id` where it is and run it again with the compute ranks of
// `compute_mask`, every doorbell seqno starting again from `seqno_base`, without the memory ranks
// of `lost_memory_ranks` (see the body layout above).
struct StepDiscardMessage {
  uint64_t step_id = 0;                     // 0: none in flight
  uint64_t seqno_base = 1;                  // >= 1
  uint8_t compute_mask = 1;                 // bit 0 always set
  bool drop = false;                        // the step is dropped, not run again (head partition)
  std::vector<uint16_t> lost_memory_ranks;  // strictly ascending

  friend bool operator==(const StepDiscardMessage&, const StepDiscardMessage&) = default;
};

// Compute rank 0 -> compute replica: memory rank `memory_rank`, given up, rejoins (a new process at
// `text`, its address): connect to it and take its outputs in buffers attn_out_buffer + lane. The
// replica answers with the same message, `answer` set and `text` empty once connected, else why
// not (see the body layout above).
struct MemoryRejoinMessage {
  uint16_t memory_rank = 0;
  bool answer = false;
  uint32_t attn_out_buffer = 0;
  std::string text;  // <= kMaxAddressBytes bytes, no NUL; a request's is not empty

  friend bool operator==(const MemoryRejoinMessage&, const MemoryRejoinMessage&) = default;
};

// Compute rank 0 -> compute replica under the head partition: the live memory ranks split the KV
// heads again (ranks[i] holds slice i of ranks.size()); the replica answers with the same split,
// `answer` set, no ranks and `text` empty once its buffers are set up, else why not (see the body
// layout above).
struct HeadSplitMessage {
  struct Rank {
    uint16_t memory_rank = 0;
    uint32_t attn_out_buffer = 0;
    uint32_t qkv_buffer = 0;
    friend bool operator==(const Rank&, const Rank&) = default;
  };
  uint64_t split = 0;  // not 0
  bool answer = false;
  std::vector<Rank> ranks;  // strictly ascending memory_rank; a request's not empty, an answer's empty
  std::string text;         // an answer's: <= kMaxAddressBytes bytes, no NUL; a request's empty

  friend bool operator==(const HeadSplitMessage&, const HeadSplitMessage&) = default;
};

// A block a memory rank's persisted disk tier found at start (kv.tiers.persist).
struct PersistedBlock {
  uint64_t hash = 0;            // not 0
  uint64_t parent_hash = 0;     // 0 exactly when depth is 1
  int32_t depth = 1;            // >= 1
  std::vector<int32_t> tokens;  // 1 to kMaxPrefixBlockTokens of them

  friend bool operator==(const PersistedBlock&, const PersistedBlock&) = default;
};

// Memory rank -> compute rank 0, after its hello reply: (part of) the blocks it found on disk.
struct PersistedBlocksMessage {
  uint16_t memory_rank = 0;
  bool last = true;  // the rank's last report
  std::vector<PersistedBlock> blocks;

  friend bool operator==(const PersistedBlocksMessage&, const PersistedBlocksMessage&) = default;
};

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial and final xor 0xFFFFFFFF): the
// SSE4.2 instruction where the CPU has it, else a table. Crc32c("123456789") == 0xE3069283.
uint32_t Crc32c(absl::Span<const uint8_t> data);
// Continues a CRC-32C: Crc32cExtend(Crc32c(a), b) == Crc32c(a followed by b); Crc32cExtend(0, a)
// == Crc32c(a).
uint32_t Crc32cExtend(uint32_t crc, absl::Span<const uint8_t> data);
// The table-driven CRC-32C that Crc32c uses where the CPU lacks SSE4.2 (for tests to compare).
uint32_t Crc32cPortableForTest(absl::Span<const uint8_t> data);

// Checks every field range listed in the table above and the links between records: a request's
// prefix_group, a group's parent and a publish's request_id name existing records of the same
// memory_rank, requests come in memory_rank order (each rank's rows one range of the step's rows,
// lower ranks first), and no two publishes or two evictions share (memory_rank, block_hash). The error is
// InvalidArgument and names the record and field, e.g. "step plan: request 3: q_len 0 must be >= 1",
// "step plan: group 2: parent 3 must be -1 or < 2", "step plan: publish 0: request 17 is not in
// the plan".
absl::Status ValidateStepPlan(const StepPlan& plan);
absl::Status ValidateLayerMessageHeader(const LayerMessageHeader& header);
// The same for the control messages, e.g. "hello: num_kv_heads 3 must divide num_heads 32",
// "hello: partition head needs num_kv_heads 2 >= num_memory_ranks 3".
absl::Status ValidateHello(const HelloMessage& hello);
absl::Status ValidateHelloReply(const HelloReplyMessage& reply);
absl::Status ValidateRelease(const ReleaseMessage& release);
absl::Status ValidateError(const ErrorMessage& error);
absl::Status ValidateBye(const ByeMessage& bye);
// Checks that `reply` answers `hello` (for the compute rank, after both decoded): the same
// memory_rank and dtype, and kv_capacity_tokens equal to the hello's where that is not 0.
// InvalidArgument naming the field otherwise.
absl::Status ValidateHelloReplyMatches(const HelloMessage& hello, const HelloReplyMessage& reply);

// Encoders write any value as given (they do not validate; a plan that ValidateStepPlan rejects
// encodes to a frame that DecodeStepPlan rejects). EncodeStepPlan aborts if the body would not
// fit in body_bytes' 32 bits (more than ~67 million requests, or the records together over 4 GiB): a
// programmer error.
std::vector<uint8_t> EncodeStepPlan(const StepPlan& plan);
std::vector<uint8_t> EncodeLayerMessageHeader(const LayerMessageHeader& header);
// EncodeHelloReply aborts if the device string exceeds 65535 bytes, EncodeRelease if the body
// would not fit in 32 bits (more than ~536 million ids), EncodeError if the message exceeds
// body_bytes' 32 bits: programmer errors (the limits the decoders enforce are far below these).
std::vector<uint8_t> EncodeHello(const HelloMessage& hello);
std::vector<uint8_t> EncodeHelloReply(const HelloReplyMessage& reply);
std::vector<uint8_t> EncodeRelease(const ReleaseMessage& release);
std::vector<uint8_t> EncodeError(const ErrorMessage& error);
std::vector<uint8_t> EncodeBye(const ByeMessage& bye);
std::vector<uint8_t> EncodeStatsRequest(const StatsRequestMessage& request);
std::vector<uint8_t> EncodeMemoryStats(const MemoryStatsMessage& stats);

// `frame` must hold exactly one frame (no trailing bytes). An OK result re-encodes to `frame`.
absl::StatusOr<StepPlan> DecodeStepPlan(absl::Span<const uint8_t> frame);
absl::StatusOr<LayerMessageHeader> DecodeLayerMessageHeader(absl::Span<const uint8_t> frame);
absl::StatusOr<HelloMessage> DecodeHello(absl::Span<const uint8_t> frame);
absl::StatusOr<HelloReplyMessage> DecodeHelloReply(absl::Span<const uint8_t> frame);
absl::StatusOr<ReleaseMessage> DecodeRelease(absl::Span<const uint8_t> frame);
absl::StatusOr<ErrorMessage> DecodeError(absl::Span<const uint8_t> frame);
absl::StatusOr<ByeMessage> DecodeBye(absl::Span<const uint8_t> frame);
absl::StatusOr<StatsRequestMessage> DecodeStatsRequest(absl::Span<const uint8_t> frame);
absl::StatusOr<MemoryStatsMessage> DecodeMemoryStats(absl::Span<const uint8_t> frame);
std::vector<uint8_t> EncodeComputeHello(const ComputeHelloMessage& hello);
absl::StatusOr<ComputeHelloMessage> DecodeComputeHello(absl::Span<const uint8_t> frame);
std::vector<uint8_t> EncodeReplicaRing(const ReplicaRingMessage& ring);
absl::StatusOr<ReplicaRingMessage> DecodeReplicaRing(absl::Span<const uint8_t> frame);
std::vector<uint8_t> EncodeReplicaStep(const ReplicaStepMessage& step);
absl::StatusOr<ReplicaStepMessage> DecodeReplicaStep(absl::Span<const uint8_t> frame);
std::vector<uint8_t> EncodeReplicaResult(const ReplicaResultMessage& result);
std::vector<uint8_t> EncodeRestoreReply(const RestoreReplyMessage& reply);
absl::StatusOr<RestoreReplyMessage> DecodeRestoreReply(absl::Span<const uint8_t> frame);
absl::StatusOr<ReplicaResultMessage> DecodeReplicaResult(absl::Span<const uint8_t> frame);
// Encoding CHECKs silence_ms is in range (a programmer's error); decoding refuses it otherwise.
std::vector<uint8_t> EncodeHeartbeat(const HeartbeatMessage& heartbeat);
absl::StatusOr<HeartbeatMessage> DecodeHeartbeat(absl::Span<const uint8_t> frame);
std::vector<uint8_t> EncodeHeartbeatReply(const HeartbeatReplyMessage& reply);
absl::StatusOr<HeartbeatReplyMessage> DecodeHeartbeatReply(absl::Span<const uint8_t> frame);
// Encoding CHECKs that lost_memory_ranks is strictly ascending and fits a u16 count; decoding
// refuses seqno_base 0, a compute_mask without bit 0 (the receiver checks the mask against its
// compute ranks), a body whose size is not 24 + 2 * lost_count, and lost ranks out of order.
std::vector<uint8_t> EncodeStepDiscard(const StepDiscardMessage& discard);
absl::StatusOr<StepDiscardMessage> DecodeStepDiscard(absl::Span<const uint8_t> frame);
// Encoding CHECKs that the body fits in kMaxPersistedBlocksBodyBytes (SplitPersistedBlocks makes
// reports that do); decoding refuses a larger body, and every field out of its range.
std::vector<uint8_t> EncodePersistedBlocks(const PersistedBlocksMessage& report);
absl::StatusOr<PersistedBlocksMessage> DecodePersistedBlocks(absl::Span<const uint8_t> frame);
// Encoding CHECKs the text's size (a programmer's error; an answer's reason is cut to
// kMaxAddressBytes by its sender); decoding refuses a text too long, with a NUL, or empty in a
// request, and reserved bytes that are not 0.
std::vector<uint8_t> EncodeMemoryRejoin(const MemoryRejoinMessage& rejoin);
absl::StatusOr<MemoryRejoinMessage> DecodeMemoryRejoin(absl::Span<const uint8_t> frame);
std::vector<uint8_t> EncodeHeadSplit(const HeadSplitMessage& split);
absl::StatusOr<HeadSplitMessage> DecodeHeadSplit(absl::Span<const uint8_t> frame);
// Memory rank `memory_rank`'s reports of `blocks` (each with 1 to kMaxPrefixBlockTokens tokens),
// in order, each body within kMaxPersistedBlocksBodyBytes: at least one (empty when `blocks` is),
// only the last marked last.
std::vector<PersistedBlocksMessage> SplitPersistedBlocks(uint16_t memory_rank,
                                                         std::vector<PersistedBlock> blocks);

// The magic of the frame at the start of `frame` (one of the k*Magic constants above), so that a
// receiver can dispatch to the decoder; nothing else of the frame is checked. DataLoss if `frame`
// is shorter than a frame header, InvalidArgument "unknown frame magic 0x........ ('....')" if the
// magic is none of the known ones.
absl::StatusOr<uint32_t> PeekFrameMagic(absl::Span<const uint8_t> frame);

// An error message carrying `status`: its code (a code outside [1, 16] becomes Unknown) and its
// message, NUL bytes replaced by '?' and cut to kMaxErrorMessageBytes, so that the result always
// passes ValidateError. An OK status becomes Unknown "(an OK status sent as an error)".
ErrorMessage ErrorMessageFromStatus(const absl::Status& status);
// The status an error message carries: its code (one outside [1, 16] becomes Unknown, with the
// code named in the message) and message. Never OK.
absl::Status StatusFromErrorMessage(const ErrorMessage& error);

}  // namespace tandem
