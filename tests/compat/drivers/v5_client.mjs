// Drive the official RocketMQ 5.x Node.js client (npm rocketmq-client-nodejs) against chronomq's gRPC
// endpoint. The harness installs the package in $CHRONOMQ_NODE5_DIR (<repo>/.node-grpc5) and runs this
// script with node; arguments are one JSON object on argv[2], the result is the last stdout line (JSON).
//
// args: endpoint (host:port, required), mode: "produce" | "receive" | "transaction", deadline_s (default 60)
// produce: topic, messages: [{body, tag, keys [..], props {..}, group (FIFO), delay_ms (deliveryTimestamp =
//   now + delay_ms, millisecond precision), recall (bool: recall it right after the send)}]
//   -> {results: [{index, message_id, offset, recall_handle, recalled, sent_ms, deliver_ms}], errors: [..]}
// receive: group, topic, expect (stop after this many acks), invisible_ms (default 20000), await_ms (long
//   polling, default 1000), batch (default 16), hold_first (bool: never ack a first delivery),
//   change_first {body: ms} (on that body's first delivery call changeInvisibleDuration(ms) instead of
//   acking, then try to ack with the handle from before the change)
//   -> {messages: [{message_id, body, tag, keys, props, attempt, group, delivery_ms, asked_ms (just before
//       the receive call that got it), received_ms, acked, ack_ms, change_ms, changed_to_ms, stale_ack}],
//       errors: [..]}
// transaction: topic, messages: [{body, decision: "commit" | "rollback"}]; the producer's checker answers
//   COMMIT and records what it was asked
//   -> {results: [{index, message_id, transaction_id, decision}], checked: [message ids], errors: [..]}

import { createRequire } from 'node:module';
import { join } from 'node:path';
import { format } from 'node:util';

function fail(msg, code = 2) {
  process.stderr.write(`driver error: ${msg}\n`);
  process.exit(code);
}

const dir = process.env.CHRONOMQ_NODE5_DIR;
if (!dir) fail('CHRONOMQ_NODE5_DIR is not set (the harness sets it)');
const require = createRequire(join(dir, 'package.json'));
const rmq = require('rocketmq-client-nodejs');
// TransactionResolution is not re-exported by the package's index
const { TransactionResolution } = require('rocketmq-client-nodejs/proto/apache/rocketmq/v2/definition_pb');

let args;
try {
  args = JSON.parse(process.argv[2] ?? '');
} catch (e) {
  fail(`argv[2] is not JSON: ${e}`);
}
for (const key of [ 'endpoint', 'mode' ]) {
  if (!(key in args)) fail(`missing argument ${key}`);
}
const deadline = Date.now() + 1000 * Number(args.deadline_s ?? 60);
// never outlive the deadline by much, whatever the client does
setTimeout(() => fail('deadline passed without a result', 3), deadline - Date.now() + 30000).unref();

// warnings and errors of the client on stderr (the harness shows them when a driver fails); debug must
// exist although the client's ILogger marks it optional: Transaction.commit/rollback call it directly
const logger = {
  info() {},
  debug() {},
  warn: (...a) => process.stderr.write(`WARN ${format(...a)}\n`),
  error: (...a) => process.stderr.write(`ERROR ${format(...a)}\n`),
  close() {},
};
const common = { endpoints: args.endpoint, namespace: '', logger, requestTimeout: 10000 };
const errText = e => `${e?.constructor?.name ?? 'Error'}: ${e?.message ?? e}`;

async function shutdown(client) {
  // a client that does not shut down within 10 s does not hold the result back
  await Promise.race([ client.shutdown(), new Promise(r => setTimeout(r, 10000).unref()) ]);
}

async function produce() {
  const topic = args.topic;
  const producer = new rmq.Producer({ ...common, topic });
  await producer.startup();
  const results = [];
  const errors = [];
  try {
    for (const [ i, spec ] of (args.messages ?? []).entries()) {
      const opts = { topic, body: Buffer.from(String(spec.body ?? `m${i}`)) };
      if (spec.tag) opts.tag = spec.tag;
      if (spec.keys) opts.keys = spec.keys;
      if (spec.props) opts.properties = new Map(Object.entries(spec.props));
      if (spec.group) opts.messageGroup = spec.group;
      if (spec.delay_ms !== undefined) opts.deliveryTimestamp = new Date(Date.now() + Number(spec.delay_ms));
      const sentMs = Date.now();
      try {
        const r = await producer.send(opts);
        const row = { index: i, message_id: r.messageId, offset: r.offset, recall_handle: r.recallHandle,
          recalled: null, sent_ms: sentMs, deliver_ms: opts.deliveryTimestamp?.getTime() ?? null };
        if (spec.recall) row.recalled = (await producer.recallMessage(topic, r.recallHandle)).messageId;
        results.push(row);
      } catch (e) {
        errors.push({ index: i, error: errText(e) });
      }
    }
  } finally {
    await shutdown(producer);
  }
  return { results, errors };
}

async function receive() {
  const topic = args.topic;
  const consumer = new rmq.SimpleConsumer({
    ...common, consumerGroup: args.group, subscriptions: new Map([[ topic, args.expression ?? '*' ]]),
    awaitDuration: Number(args.await_ms ?? 1000),
  });
  await consumer.startup();
  const expect = Number(args.expect ?? 1);
  const invisible = Number(args.invisible_ms ?? 20000);
  const changeFirst = args.change_first ?? {};
  const messages = [];
  const errors = [];
  let acked = 0;
  try {
    while (acked < expect && Date.now() < deadline) {
      let got;
      const askedMs = Date.now();
      try {
        got = await consumer.receive(Number(args.batch ?? 16), invisible);
      } catch (e) {
        errors.push(`receive: ${errText(e)}`);
        continue;
      }
      for (const m of got) {
        const body = m.body.toString();
        const row = { message_id: m.messageId, body, tag: m.tag ?? null, keys: [ ...m.keys ].sort(),
          props: Object.fromEntries(m.properties), attempt: m.deliveryAttempt, group: m.messageGroup || null,
          delivery_ms: m.deliveryTimestamp?.getTime() ?? null, asked_ms: askedMs, received_ms: Date.now(),
          acked: false };
        messages.push(row);
        if (m.deliveryAttempt === 1 && body in changeFirst) {
          const before = m.receiptHandle;
          row.change_ms = Date.now();
          try {
            await consumer.changeInvisibleDuration(m, Number(changeFirst[body]));
            row.changed_to_ms = Number(changeFirst[body]);
          } catch (e) {
            errors.push(`changeInvisibleDuration ${body}: ${errText(e)}`);
          }
          try {  // the handle from before the change must be refused now
            await consumer.ack({ ...m, receiptHandle: before });
            row.stale_ack = 'accepted';
          } catch (e) {
            row.stale_ack = errText(e);
          }
          continue;
        }
        if (args.hold_first && m.deliveryAttempt === 1) continue;
        row.ack_ms = Date.now();
        try {
          await consumer.ack(m);
          row.acked = true;
          acked += 1;
        } catch (e) {
          errors.push(`ack ${body}: ${errText(e)}`);
        }
      }
    }
  } finally {
    await shutdown(consumer);
  }
  return { messages, errors };
}

async function transaction() {
  const topic = args.topic;
  const checked = [];
  const checker = {
    async check(view) {
      checked.push(view.messageId);
      return TransactionResolution.COMMIT;
    },
  };
  const producer = new rmq.Producer({ ...common, topic, checker });
  await producer.startup();
  const results = [];
  const errors = [];
  try {
    for (const [ i, spec ] of (args.messages ?? []).entries()) {
      const decision = spec.decision ?? 'commit';
      try {
        const tx = producer.beginTransaction();
        const r = await producer.send({ topic, body: Buffer.from(String(spec.body ?? `m${i}`)) }, tx);
        if (decision === 'commit') await tx.commit();
        else await tx.rollback();
        results.push({ index: i, message_id: r.messageId, transaction_id: r.transactionId, decision });
      } catch (e) {
        errors.push({ index: i, error: errText(e) });
      }
    }
  } finally {
    await shutdown(producer);
  }
  return { results, checked, errors };
}

const modes = { produce, receive, transaction };
if (!(args.mode in modes)) fail(`unknown mode ${JSON.stringify(args.mode)}`);
try {
  const result = await modes[args.mode]();
  process.stdout.write(JSON.stringify(result) + '\n', () => process.exit(0));
} catch (e) {
  fail(`${args.mode}: ${e?.stack ?? e}`);
}
