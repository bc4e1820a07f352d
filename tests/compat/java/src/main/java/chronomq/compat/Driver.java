package chronomq.compat;

import com.google.gson.Gson;
import com.google.gson.GsonBuilder;
import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import java.io.FileWriter;
import java.io.IOException;
import java.io.Writer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Base64;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import org.apache.rocketmq.client.consumer.DefaultLitePullConsumer;
import org.apache.rocketmq.client.consumer.DefaultMQPushConsumer;
import org.apache.rocketmq.client.consumer.MessageSelector;
import org.apache.rocketmq.client.consumer.rebalance.AllocateMessageQueueAveragely;
import org.apache.rocketmq.client.consumer.listener.ConsumeConcurrentlyStatus;
import org.apache.rocketmq.client.consumer.listener.ConsumeOrderlyStatus;
import org.apache.rocketmq.client.consumer.listener.MessageListenerConcurrently;
import org.apache.rocketmq.client.consumer.listener.MessageListenerOrderly;
import org.apache.rocketmq.client.exception.MQBrokerException;
import org.apache.rocketmq.client.exception.MQClientException;
import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.LocalTransactionState;
import org.apache.rocketmq.client.producer.SendCallback;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.client.producer.TransactionListener;
import org.apache.rocketmq.client.producer.TransactionMQProducer;
import org.apache.rocketmq.client.producer.TransactionSendResult;
import org.apache.rocketmq.client.utils.MessageUtil;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageAccessor;
import org.apache.rocketmq.common.message.MessageExt;
import org.apache.rocketmq.common.message.MessageQueue;
import org.apache.rocketmq.common.protocol.heartbeat.MessageModel;
import org.apache.rocketmq.tools.admin.DefaultMQAdminExt;

/**
 * A compatibility driver on the official RocketMQ Java client's 4.x API (rocketmq-client 4.9.x; the same
 * source builds for the 5.3.x remoting client, where the harness compiles it with the classes that moved
 * from org.apache.rocketmq.common.protocol to org.apache.rocketmq.remoting.protocol renamed). One JSON object
 * on argv[0]; the result is the last stdout line, in JSON. With argv "serve" the JVM runs requests from stdin
 * side by side instead (serve, below). Streaming operations append a JSON line per delivery to args.out.
 * Errors a client sees are reported as {"code": responseCode, "message": errorMessage, "type": exceptionClass}.
 */
public final class Driver {
    static final Gson GSON = new GsonBuilder().disableHtmlEscaping().serializeNulls().create();

    /** True in the serve mode: ops run side by side in one JVM that outlives them. */
    static volatile boolean serving;
    /**
     * The request id of the op on this thread in the serve mode ("-id"; "" in the one-shot mode): part of
     * every client instance name, so concurrent ops get their own MQClientInstance (the 4.x client shares
     * one per client id, IP@instanceName, with the name server of the first client that made it).
     */
    static final ThreadLocal<String> REQUEST = ThreadLocal.withInitial(() -> "");

    public static void main(String[] argv) throws Exception {
        java.io.PrintStream stdout = System.out;
        System.setOut(System.err);  // the client's own logging may write to stdout: the result line is ours
        if (argv.length == 1 && argv[0].equals("serve")) {
            serve(stdout);
            return;
        }
        JsonObject result = run(JsonParser.parseString(argv[0]).getAsJsonObject());
        stdout.println(GSON.toJson(result));
        stdout.flush();
        Runtime.getRuntime().halt(0);  // client threads (netty, timers) need not linger
    }

    static JsonObject run(JsonObject args) throws Exception {
        String op = args.get("op").getAsString();
        switch (op) {
            case "bench_produce": return benchProduce(args);
            case "bench_consume": return benchConsume(args);
            case "produce": return produce(args);
            case "push_consume": return pushConsume(args);
            case "admin": return admin(args);
            case "transaction": return transaction(args);
            case "request_reply": return requestReply(args);
            case "lite_pull": return litePull(args);
            case "status": return status();
            default: throw new IllegalArgumentException("unknown op " + op);
        }
    }

    /**
     * The serve mode (argv: serve): one JSON request per stdin line, {"id": n, "op": ..., the op's args},
     * each run on a thread of its own; one line per request on stdout, written whole under a lock:
     * {"id": n, "result": {...}} or {"id": n, "error": {"type", "code", "message", "stack"}}. Every op
     * shuts its clients down before it answers. The JVM halts when stdin closes.
     */
    static void serve(java.io.PrintStream answers) throws IOException {
        serving = true;
        java.io.BufferedReader in = new java.io.BufferedReader(
            new java.io.InputStreamReader(System.in, StandardCharsets.UTF_8));
        for (String line = in.readLine(); line != null; line = in.readLine()) {
            String request = line;
            if (!request.isBlank()) {
                Thread t = new Thread(() -> answer(request, answers), "driver-op");
                t.setDaemon(true);
                t.start();
            }
        }
        Runtime.getRuntime().halt(0);
    }

    static void answer(String request, java.io.PrintStream answers) {
        JsonObject reply = new JsonObject();
        try {
            JsonObject args = JsonParser.parseString(request).getAsJsonObject();
            reply.add("id", args.get("id"));
            REQUEST.set("-" + args.get("id").getAsString());
            Thread.currentThread().setName("driver-op-" + args.get("id").getAsString());
            reply.add("result", run(args));
        } catch (Throwable t) {
            java.io.StringWriter stack = new java.io.StringWriter();
            t.printStackTrace(new java.io.PrintWriter(stack));
            JsonObject e = error(t);
            e.addProperty("stack", stack.toString());
            reply.add("error", e);
        }
        String line = GSON.toJson(reply);
        synchronized (answers) {
            answers.println(line);
            answers.flush();
        }
    }

    /**
     * The live threads but this one, by name, and each heap pool's peak use and size in MB since the JVM
     * started (the serve mode's checks: ops leave no thread behind; what the heap cap leaves spare).
     */
    static JsonObject status() {
        JsonArray names = new JsonArray();
        Thread.getAllStackTraces().keySet().stream().filter(t -> t != Thread.currentThread())
            .map(Thread::getName).sorted().forEach(names::add);
        JsonObject heap = new JsonObject();
        for (java.lang.management.MemoryPoolMXBean pool
                 : java.lang.management.ManagementFactory.getMemoryPoolMXBeans()) {
            if (pool.getType() == java.lang.management.MemoryType.HEAP) {
                JsonObject p = new JsonObject();
                p.addProperty("peakUsedMB", pool.getPeakUsage().getUsed() >> 20);
                p.addProperty("committedMB", pool.getUsage().getCommitted() >> 20);
                p.addProperty("maxMB", pool.getUsage().getMax() >> 20);
                heap.add(pool.getName(), p);
            }
        }
        JsonObject out = new JsonObject();
        out.add("threads", names);
        out.add("heap", heap);
        return out;
    }

    // ---- helpers ----------------------------------------------------------------------------------------
    static String str(JsonObject o, String k, String dflt) {
        JsonElement e = o.get(k);
        return e == null || e.isJsonNull() ? dflt : e.getAsString();
    }

    static long num(JsonObject o, String k, long dflt) {
        JsonElement e = o.get(k);
        return e == null || e.isJsonNull() ? dflt : e.getAsLong();
    }

    static boolean flag(JsonObject o, String k) {
        JsonElement e = o.get(k);
        return e != null && !e.isJsonNull() && e.getAsBoolean();
    }

    static JsonObject error(Throwable t) {
        JsonObject e = new JsonObject();
        while (t.getCause() != null && !(t instanceof MQClientException) && !(t instanceof MQBrokerException)) {
            t = t.getCause();
        }
        e.addProperty("type", t.getClass().getSimpleName());
        if (t instanceof MQClientException) {
            MQClientException c = (MQClientException) t;
            e.addProperty("code", c.getResponseCode());
            e.addProperty("message", c.getErrorMessage());
        } else if (t instanceof MQBrokerException) {
            MQBrokerException b = (MQBrokerException) t;
            e.addProperty("code", b.getResponseCode());
            e.addProperty("message", b.getErrorMessage());
        } else {
            e.addProperty("code", -1);
            e.addProperty("message", String.valueOf(t.getMessage()));
        }
        return e;
    }

    static Message message(JsonObject m) {
        byte[] body = Base64.getDecoder().decode(str(m, "body", ""));
        if (m.has("bodySize")) {  // a large body made here: it would not fit on a command line
            body = new byte[(int) num(m, "bodySize", 0)];
            java.util.Arrays.fill(body, (byte) 'x');
        }
        Message msg = new Message(m.get("topic").getAsString(), str(m, "tags", null), str(m, "keys", null), body);
        if (m.has("delayLevel")) {
            msg.setDelayTimeLevel((int) num(m, "delayLevel", 0));
        }
        if (m.has("deliverTimeMs")) {  // what the 5.x API's setDeliverTimeMs writes
            MessageAccessor.putProperty(msg, "TIMER_DELIVER_MS", String.valueOf(num(m, "deliverTimeMs", 0)));
        }
        if (m.has("delaySec")) {  // what the 5.x API's setDelayTimeSec writes
            MessageAccessor.putProperty(msg, "TIMER_DELAY_SEC", String.valueOf(num(m, "delaySec", 0)));
        }
        if (m.has("props")) {
            for (Map.Entry<String, JsonElement> p : m.getAsJsonObject("props").entrySet()) {
                msg.putUserProperty(p.getKey(), p.getValue().getAsString());
            }
        }
        return msg;
    }

    static JsonObject sent(SendResult r) {
        JsonObject o = new JsonObject();
        o.addProperty("ok", true);
        o.addProperty("status", r.getSendStatus().name());
        o.addProperty("msgId", r.getMsgId());
        o.addProperty("offsetMsgId", r.getOffsetMsgId());
        o.addProperty("queueId", r.getMessageQueue().getQueueId());
        o.addProperty("queueOffset", r.getQueueOffset());
        return o;
    }

    static JsonObject failed(Throwable t) {
        JsonObject o = new JsonObject();
        o.addProperty("ok", false);
        o.add("error", error(t));
        return o;
    }

    static JsonObject describe(MessageExt m, long now) {
        JsonObject o = new JsonObject();
        o.addProperty("msgId", m.getMsgId());
        o.addProperty("topic", m.getTopic());
        o.addProperty("queueId", m.getQueueId());
        o.addProperty("queueOffset", m.getQueueOffset());
        o.addProperty("body", Base64.getEncoder().encodeToString(m.getBody()));
        o.addProperty("tags", m.getTags());
        o.addProperty("keys", m.getKeys());
        o.addProperty("reconsumeTimes", m.getReconsumeTimes());
        o.addProperty("bornTimestamp", m.getBornTimestamp());
        o.addProperty("storeTimestamp", m.getStoreTimestamp());
        o.addProperty("receivedAt", now);
        JsonObject props = new JsonObject();
        for (Map.Entry<String, String> p : m.getProperties().entrySet()) {
            props.addProperty(p.getKey(), p.getValue());
        }
        o.add("props", props);
        return o;
    }

    /** A client instance name unique to this process and, in the serve mode, to the op (REQUEST). */
    static String instance(String prefix) {
        return prefix + "-" + ProcessHandle.current().pid() + REQUEST.get();
    }

    static DefaultMQProducer configure(DefaultMQProducer p, JsonObject args) {
        p.setNamesrvAddr(args.get("namesrv").getAsString());
        p.setSendMsgTimeout((int) num(args, "timeoutMs", 10000));
        p.setRetryTimesWhenSendFailed((int) num(args, "retries", 2));
        p.setVipChannelEnabled(false);
        tls(p, args);
        p.setInstanceName(instance("driver"));
        return p;
    }

    /**
     * args.tls (default false): the client's connections, to the name servers and the brokers alike, over
     * TLS, as ClientConfig.setUseTLS(true) puts them (what -Dtls.enable=true sets as every client's default;
     * a property of the whole JVM, so not usable per op in the serve mode). Its context is
     * TlsHelper.buildSslContext(true) with the JVM's tls.* properties: in their defaults (test mode) it
     * trusts any server certificate and presents none. Each op's client has an instance of its own (instance),
     * so TLS and plaintext clients never share a connection.
     */
    static <T extends org.apache.rocketmq.client.ClientConfig> T tls(T client, JsonObject args) {
        if (flag(args, "tls")) {
            client.setUseTLS(true);
        }
        return client;
    }

    // ---- bench: scheduling rate and lateness as the official client sees them (bench/compare) -----------
    /** A body "prefix seq|due|" padded with 'x' to size bytes: the consumer learns the due time from it. */
    static byte[] benchBody(String prefix, int seq, long due, int size) {
        byte[] head = (prefix + seq + "|" + due + "|").getBytes(StandardCharsets.UTF_8);
        byte[] body = new byte[Math.max(size, head.length)];
        java.util.Arrays.fill(body, (byte) 'x');
        System.arraycopy(head, 0, body, 0, head.length);
        return body;
    }

    /** Nearest-rank percentile of sorted values (as bench/compare/workloads.py computes it). */
    static long benchPercentile(long[] sorted, double p) {
        int rank = Math.max(1, (int) Math.ceil(p / 100 * sorted.length));
        return sorted[rank - 1];
    }

    /**
     * count messages as fast as possible, window async sends in flight. mode "timed": TIMER_DELIVER_MS
     * spread evenly over windowMs starting leadMs after the producer started; mode "levels": delay level
     * 1 + seq % levelsMs.length, due at send time + that level's delay. Bounded by count and capMs.
     */
    static JsonObject benchProduce(JsonObject args) throws Exception {
        DefaultMQProducer p = configure(new DefaultMQProducer(args.get("group").getAsString()), args);
        p.start();
        String topic = args.get("topic").getAsString();
        String prefix = args.get("prefix").getAsString();
        int count = (int) num(args, "count", 1000);
        int size = (int) num(args, "bodySize", 1024);
        long timeout = num(args, "timeoutMs", 10000);
        long capMs = num(args, "capMs", 60000);
        boolean timed = str(args, "mode", "timed").equals("timed");
        JsonArray levels = args.has("levelsMs") ? args.getAsJsonArray("levelsMs") : new JsonArray();
        java.util.concurrent.Semaphore window = new java.util.concurrent.Semaphore((int) num(args, "window", 128));
        AtomicInteger ok = new AtomicInteger();
        AtomicInteger failed = new AtomicInteger();
        java.util.concurrent.atomic.AtomicLong lastAck = new java.util.concurrent.atomic.AtomicLong();
        java.util.concurrent.atomic.AtomicReference<String> firstError = new java.util.concurrent.atomic.AtomicReference<>();
        long t0 = System.currentTimeMillis();
        long start = t0 + num(args, "leadMs", 5000);
        long windowMs = num(args, "windowMs", 10000);
        long firstDue = Long.MAX_VALUE;
        long lastDue = 0;
        int issued = 0;
        boolean capped = false;
        try {
            for (int i = 0; i < count; i++) {
                if (System.currentTimeMillis() - t0 > capMs) {
                    capped = true;
                    break;
                }
                window.acquire();
                long due;
                Message msg;
                if (timed) {
                    due = start + i * windowMs / count;
                    msg = new Message(topic, benchBody(prefix, i, due, size));
                    MessageAccessor.putProperty(msg, "TIMER_DELIVER_MS", String.valueOf(due));
                } else {
                    int level = 1 + i % levels.size();
                    due = System.currentTimeMillis() + levels.get(level - 1).getAsLong();
                    msg = new Message(topic, benchBody(prefix, i, due, size));
                    msg.setDelayTimeLevel(level);
                }
                firstDue = Math.min(firstDue, due);
                lastDue = Math.max(lastDue, due);
                issued++;
                try {
                    p.send(msg, new SendCallback() {
                        public void onSuccess(SendResult r) {
                            ok.incrementAndGet();
                            lastAck.accumulateAndGet(System.currentTimeMillis(), Math::max);
                            window.release();
                        }

                        public void onException(Throwable t) {
                            failed.incrementAndGet();
                            firstError.compareAndSet(null, String.valueOf(t));
                            window.release();
                        }
                    }, timeout);
                } catch (Exception e) {
                    failed.incrementAndGet();
                    firstError.compareAndSet(null, String.valueOf(e));
                    window.release();
                }
            }
            long deadline = System.currentTimeMillis() + timeout * 2 + 5000;
            while (ok.get() + failed.get() < issued && System.currentTimeMillis() < deadline) {
                Thread.sleep(1);
            }
        } finally {
            p.shutdown();
        }
        long elapsed = Math.max(1, lastAck.get() - t0);
        JsonObject out = new JsonObject();
        out.addProperty("issued", issued);
        out.addProperty("ok", ok.get());
        out.addProperty("failed", failed.get());
        out.addProperty("firstError", firstError.get());
        out.addProperty("capped", capped);
        out.addProperty("startedMs", t0);
        out.addProperty("lastAckMs", lastAck.get());
        out.addProperty("elapsedMs", elapsed);
        out.addProperty("msgsPerS", ok.get() * 1000.0 / elapsed);
        out.addProperty("firstDueMs", firstDue == Long.MAX_VALUE ? 0 : firstDue);
        out.addProperty("lastDueMs", lastDue);
        return out;
    }

    /**
     * A push consumer counting bodies that start with prefix: first receipt time minus the due time in the
     * body, per message; stops at expect distinct messages or after maxSeconds. Writes readyFile once
     * started. Prints percentiles, early receipts (before the due time) and duplicates.
     */
    static JsonObject benchConsume(JsonObject args) throws Exception {
        DefaultMQPushConsumer c = new DefaultMQPushConsumer(args.get("group").getAsString());
        c.setNamesrvAddr(args.get("namesrv").getAsString());
        c.setInstanceName(instance("bench"));
        c.setVipChannelEnabled(false);
        tls(c, args);
        c.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        c.setPullBatchSize(32);
        c.setConsumeMessageBatchMaxSize(32);
        c.subscribe(args.get("topic").getAsString(), "*");
        String prefix = args.get("prefix").getAsString();
        int expect = (int) num(args, "expect", 1);
        Map<Integer, Long> late = new ConcurrentHashMap<>();
        AtomicInteger receipts = new AtomicInteger();
        AtomicInteger duplicates = new AtomicInteger();
        AtomicInteger early = new AtomicInteger();
        AtomicInteger foreign = new AtomicInteger();
        java.util.concurrent.atomic.AtomicLong lastRecv = new java.util.concurrent.atomic.AtomicLong();
        CountDownLatch enough = new CountDownLatch(1);
        c.registerMessageListener((MessageListenerConcurrently) (ms, ctx) -> {
            long now = System.currentTimeMillis();
            for (MessageExt m : ms) {
                String head = new String(m.getBody(), 0, Math.min(200, m.getBody().length), StandardCharsets.UTF_8);
                if (!head.startsWith(prefix)) {
                    foreign.incrementAndGet();
                    continue;
                }
                String[] parts = head.substring(prefix.length()).split("\\|", 3);
                int seq = Integer.parseInt(parts[0]);
                long due = Long.parseLong(parts[1]);
                receipts.incrementAndGet();
                if (now < due) {
                    early.incrementAndGet();
                }
                if (late.putIfAbsent(seq, now - due) != null) {
                    duplicates.incrementAndGet();
                } else {
                    lastRecv.accumulateAndGet(now, Math::max);
                    if (late.size() >= expect) {
                        enough.countDown();
                    }
                }
            }
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
        });
        try {
            c.start();
            if (args.has("readyFile")) {
                java.nio.file.Files.writeString(java.nio.file.Path.of(args.get("readyFile").getAsString()), "ready\n");
            }
            enough.await(num(args, "maxSeconds", 60), TimeUnit.SECONDS);
        } finally {
            c.shutdown();
        }
        long[] values = late.values().stream().mapToLong(Long::longValue).sorted().toArray();
        JsonObject out = new JsonObject();
        out.addProperty("received", values.length);
        out.addProperty("receipts", receipts.get());
        out.addProperty("duplicates", duplicates.get());
        out.addProperty("early", early.get());
        out.addProperty("foreign", foreign.get());
        out.addProperty("lastRecvMs", lastRecv.get());
        if (values.length > 0) {
            out.addProperty("p50Ms", benchPercentile(values, 50));
            out.addProperty("p99Ms", benchPercentile(values, 99));
            out.addProperty("maxMs", values[values.length - 1]);
            out.addProperty("minMs", values[0]);
        }
        return out;
    }

    // ---- produce ----------------------------------------------------------------------------------------
    static JsonObject produce(JsonObject args) throws Exception {
        DefaultMQProducer p = configure(new DefaultMQProducer(args.get("group").getAsString(),
            null, flag(args, "trace"), null), args);
        p.start();
        long timeout = num(args, "timeoutMs", 10000);
        JsonObject out = new JsonObject();
        try {
            if (args.has("rounds")) {  // several modes, one after the other, on one producer
                JsonArray rounds = new JsonArray();
                for (JsonElement r : args.getAsJsonArray("rounds")) {
                    JsonObject round = r.getAsJsonObject();
                    rounds.add(sendRound(p, str(round, "mode", "sync"), round.getAsJsonArray("messages"), timeout));
                }
                out.add("rounds", rounds);
            } else {
                out.add("results", sendRound(p, str(args, "mode", "sync"), args.getAsJsonArray("messages"), timeout));
            }
        } finally {
            drainTraces(p.getTraceDispatcher());
            p.shutdown();
        }
        return out;
    }

    static JsonArray sendRound(DefaultMQProducer p, String mode, JsonArray msgs, long timeout)
            throws InterruptedException {
        JsonArray results = new JsonArray();
        {
            if (mode.equals("batch")) {
                List<Message> batch = new ArrayList<>();
                for (JsonElement m : msgs) {
                    batch.add(message(m.getAsJsonObject()));
                }
                try {
                    results.add(sent(p.send(batch, timeout)));
                } catch (Exception e) {
                    results.add(failed(e));
                }
            } else if (mode.equals("async")) {
                JsonObject[] slots = new JsonObject[msgs.size()];
                CountDownLatch done = new CountDownLatch(msgs.size());
                for (int i = 0; i < msgs.size(); i++) {
                    final int idx = i;
                    try {
                        p.send(message(msgs.get(i).getAsJsonObject()), new SendCallback() {
                            public void onSuccess(SendResult r) { slots[idx] = sent(r); done.countDown(); }
                            public void onException(Throwable t) { slots[idx] = failed(t); done.countDown(); }
                        }, timeout);
                    } catch (Exception e) {
                        slots[idx] = failed(e);
                        done.countDown();
                    }
                }
                done.await(timeout * 2 + 5000, TimeUnit.MILLISECONDS);
                for (JsonObject s : slots) {
                    results.add(s == null ? failed(new RuntimeException("no callback")) : s);
                }
            } else {
                for (JsonElement e : msgs) {
                    JsonObject m = e.getAsJsonObject();
                    try {
                        Message msg = message(m);
                        if (mode.equals("oneway")) {
                            p.sendOneway(msg);
                            JsonObject o = new JsonObject();
                            o.addProperty("ok", true);
                            results.add(o);
                        } else if (mode.equals("orderly")) {
                            final String key = str(m, "shardingKey", "");
                            results.add(sent(p.send(msg, (mqs, ms, arg) ->
                                mqs.get(Math.floorMod(arg.hashCode(), mqs.size())), key, timeout)));
                        } else {
                            results.add(sent(p.send(msg, timeout)));
                        }
                    } catch (Exception ex) {
                        results.add(failed(ex));
                    }
                }
            }
        }
        return results;
    }

    /**
     * With enableMsgTrace a producer or consumer hands its trace records to a background worker thread and
     * executor that send them asynchronously; shutdown() does not wait for a send in flight (and stops the
     * trace producer). The dispatcher's own flush() gives up after 500 ms and can return while the worker
     * holds a record between its queue and its batch (4.9.x keeps batches per topic until they fill or age).
     * So: flush, and again whenever a record is still queued, batched or being sent, until nothing has been
     * for 300 ms in a row (bounded: 20 s), so the records are on the wire before the client shuts down.
     */
    static void drainTraces(Object dispatcher) {
        if (dispatcher == null) {
            return;
        }
        try {
            java.lang.reflect.Method flush = dispatcher.getClass().getMethod("flush");
            java.util.concurrent.ThreadPoolExecutor ex =
                (java.util.concurrent.ThreadPoolExecutor) field(dispatcher, "traceExecutor");
            java.util.Collection<?> contexts = (java.util.Collection<?>) field(dispatcher, "traceContextQueue");
            java.util.Collection<?> appender = (java.util.Collection<?>) field(dispatcher, "appenderQueue");
            Map<?, ?> segments = null;  // 4.9.x only: the batches per trace topic
            try {
                segments = (Map<?, ?>) field(dispatcher, "taskQueueByTopic");
            } catch (NoSuchFieldException e) {
                // 5.x batches in its worker thread
            }
            long deadline = System.currentTimeMillis() + 20000;
            long idleSince = -1;
            while (System.currentTimeMillis() < deadline) {
                boolean pending = !contexts.isEmpty() || !appender.isEmpty() || ex.getActiveCount() > 0
                    || !ex.getQueue().isEmpty() || batched(segments);
                long now = System.currentTimeMillis();
                if (pending) {
                    idleSince = -1;
                    flush.invoke(dispatcher);
                } else if (idleSince < 0) {
                    idleSince = now;
                } else if (now - idleSince >= 300) {
                    return;
                }
                Thread.sleep(5);
            }
            System.err.println("trace drain: records still pending after 20 s");
        } catch (ReflectiveOperationException | InterruptedException e) {
            System.err.println("trace drain: " + e);
        }
    }

    static Object field(Object o, String name) throws ReflectiveOperationException {
        java.lang.reflect.Field f = o.getClass().getDeclaredField(name);
        f.setAccessible(true);
        return f.get(o);
    }

    static boolean batched(Map<?, ?> segments) throws ReflectiveOperationException {
        if (segments == null) {
            return false;
        }
        synchronized (segments) {
            for (Object segment : segments.values()) {
                if (!((java.util.Collection<?>) field(segment, "traceTransferBeanList")).isEmpty()) {
                    return true;
                }
            }
        }
        return false;
    }

    // ---- push consume -----------------------------------------------------------------------------------
    /**
     * Stops at expect accepted messages, expectDeliveries deliveries, quietMs without a delivery once one
     * came, or after maxSeconds, whichever is first.
     */
    static JsonObject pushConsume(JsonObject args) throws Exception {
        DefaultMQPushConsumer c = new DefaultMQPushConsumer(args.get("group").getAsString(), null,
            new AllocateMessageQueueAveragely(), flag(args, "trace"), null);
        c.setNamesrvAddr(args.get("namesrv").getAsString());
        c.setInstanceName(instance("driver"));
        c.setVipChannelEnabled(false);
        tls(c, args);
        c.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        c.setPullBatchSize(32);
        if (args.has("maxReconsumeTimes")) {
            c.setMaxReconsumeTimes((int) num(args, "maxReconsumeTimes", 16));
        }
        if (flag(args, "broadcasting")) {
            c.setMessageModel(MessageModel.BROADCASTING);
        }
        c.setSuspendCurrentQueueTimeMillis(num(args, "suspendMs", 1000));
        c.setAwaitTerminationMillisWhenShutdown(10000);
        String topic = args.get("topic").getAsString();
        String expr = str(args, "expression", "*");
        if (str(args, "type", "TAG").equals("SQL92")) {
            c.subscribe(topic, MessageSelector.bySql(expr));
        } else {
            c.subscribe(topic, expr);
        }
        int later = (int) num(args, "reconsumeLater", 0);
        int expect = (int) num(args, "expect", Integer.MAX_VALUE);
        int expectDeliveries = (int) num(args, "expectDeliveries", Integer.MAX_VALUE);
        Map<String, AtomicInteger> seen = new ConcurrentHashMap<>();
        AtomicInteger consumed = new AtomicInteger();
        AtomicInteger deliveries = new AtomicInteger();
        java.util.concurrent.atomic.AtomicLong lastDelivery = new java.util.concurrent.atomic.AtomicLong();
        CountDownLatch enough = new CountDownLatch(1);
        Writer out = new FileWriter(args.get("out").getAsString(), StandardCharsets.UTF_8, true);
        Object lock = new Object();
        java.util.function.Function<MessageExt, Boolean> handle = m -> {
            long now = System.currentTimeMillis();
            int n = seen.computeIfAbsent(m.getMsgId() + "", k -> new AtomicInteger()).incrementAndGet();
            boolean accept = m.getReconsumeTimes() >= later;
            JsonObject rec = describe(m, now);
            rec.addProperty("accepted", accept);
            rec.addProperty("thread", Thread.currentThread().getName());
            synchronized (lock) {
                try {
                    out.write(GSON.toJson(rec) + "\n");
                    out.flush();
                } catch (IOException e) {
                    throw new RuntimeException(e);
                }
            }
            lastDelivery.set(now);
            if (deliveries.incrementAndGet() >= expectDeliveries) {
                enough.countDown();
            }
            if (accept && consumed.incrementAndGet() >= expect) {
                enough.countDown();
            }
            return accept;
        };
        if (flag(args, "orderly")) {
            c.registerMessageListener((MessageListenerOrderly) (ms, ctx) -> {
                for (MessageExt m : ms) {
                    if (!handle.apply(m)) {
                        return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT;
                    }
                }
                return ConsumeOrderlyStatus.SUCCESS;
            });
        } else {
            c.setConsumeMessageBatchMaxSize(1);
            c.registerMessageListener((MessageListenerConcurrently) (ms, ctx) -> {
                for (MessageExt m : ms) {
                    if (!handle.apply(m)) {
                        return ConsumeConcurrentlyStatus.RECONSUME_LATER;
                    }
                }
                return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
            });
        }
        JsonObject res = new JsonObject();
        try {
            try {
                c.start();
            } catch (MQClientException e) {  // it may have started its client instance first (SQL92 check)
                res.addProperty("started", false);
                res.add("error", error(e));
                return res;
            }
            if (!serving) {  // SIGTERM (DriverProcess.stop): stop waiting, shut down, print the result
                Runtime.getRuntime().addShutdownHook(new Thread(enough::countDown));
            }
            long quietMs = num(args, "quietMs", 0);
            if (quietMs > 0) {  // stop once deliveries began and none came for quietMs
                long deadline = System.currentTimeMillis() + num(args, "maxSeconds", 60) * 1000;
                while (enough.getCount() > 0 && System.currentTimeMillis() < deadline
                       && !(deliveries.get() > 0 && System.currentTimeMillis() - lastDelivery.get() >= quietMs)) {
                    Thread.sleep(50);
                }
                enough.countDown();
            }
            enough.await(num(args, "maxSeconds", 60), TimeUnit.SECONDS);
            // the consumer first: it waits for the listener calls in flight and their send-backs (below),
            // whose consume traces (SubAfter) are queued as each call returns; then those traces; then the rest
            c.getDefaultMQPushConsumerImpl().shutdown(c.getAwaitTerminationMillisWhenShutdown());
            drainTraces(c.getTraceDispatcher());
        } finally {
            c.shutdown();
            out.close();
        }
        res.addProperty("started", true);
        res.addProperty("consumed", consumed.get());
        res.addProperty("deliveries", deliveries.get());
        return res;
    }

    // ---- admin ------------------------------------------------------------------------------------------
    static JsonObject admin(JsonObject args) throws Exception {
        DefaultMQAdminExt a = new DefaultMQAdminExt(num(args, "timeoutMs", 10000));
        a.setNamesrvAddr(args.get("namesrv").getAsString());
        a.setInstanceName(instance("driver"));
        a.setVipChannelEnabled(false);
        tls(a, args);
        a.start();
        JsonArray steps = new JsonArray();
        try {
            for (JsonElement e : args.getAsJsonArray("steps")) {
                JsonObject s = e.getAsJsonObject();
                JsonObject r = new JsonObject();
                r.addProperty("step", s.get("do").getAsString());
                try {
                    switch (s.get("do").getAsString()) {
                        case "createTopic":  // MQAdmin.createTopic: the route of the cluster-named topic first
                            a.createTopic(str(s, "key", "DefaultCluster"), s.get("topic").getAsString(),
                                (int) num(s, "queues", 4), /*ATTRIBUTES*/ 0);
                            break;
                        case "route": {
                            org.apache.rocketmq.common.protocol.route.TopicRouteData route =
                                a.examineTopicRouteInfo(s.get("topic").getAsString());
                            int w = 0;
                            int rq = 0;
                            for (org.apache.rocketmq.common.protocol.route.QueueData q : route.getQueueDatas()) {
                                w += q.getWriteQueueNums();
                                rq += q.getReadQueueNums();
                            }
                            r.addProperty("writeQueues", w);
                            r.addProperty("readQueues", rq);
                            r.addProperty("brokers", route.getBrokerDatas().size());
                            break;
                        }
                        case "clusterInfo": {
                            JsonArray clusters = new JsonArray();
                            a.examineBrokerClusterInfo().getClusterAddrTable().keySet().forEach(clusters::add);
                            r.add("clusters", clusters);
                            break;
                        }
                        case "queryByKey": {
                            JsonArray found = new JsonArray();
                            long now = System.currentTimeMillis();
                            for (MessageExt m : a.queryMessage(s.get("topic").getAsString(),
                                    s.get("key").getAsString(), 32, 0, Long.MAX_VALUE).getMessageList()) {
                                found.add(describe(m, now));
                            }
                            r.add("messages", found);
                            break;
                        }
                        case "viewById": {
                            MessageExt m = a.viewMessage(s.get("topic").getAsString(), s.get("id").getAsString());
                            r.add("message", describe(m, System.currentTimeMillis()));
                            break;
                        }
                        case "resetOffsetByTime": {  // mqadmin resetOffsetByTime: the group's online consumers jump
                            Map<org.apache.rocketmq.common.message.MessageQueue, Long> moved =
                                a.resetOffsetByTimestamp(s.get("topic").getAsString(), s.get("group").getAsString(),
                                    num(s, "timestamp", 0), true);
                            long sum = 0;
                            for (long o : moved.values()) {
                                sum += o;
                            }
                            r.addProperty("queues", moved.size());
                            r.addProperty("offsetSum", sum);
                            break;
                        }
                        default: throw new IllegalArgumentException("unknown admin step " + s.get("do"));
                    }
                    r.addProperty("ok", true);
                } catch (Exception ex) {
                    r.addProperty("ok", false);
                    r.add("error", error(ex));
                }
                steps.add(r);
            }
        } finally {
            a.shutdown();
        }
        JsonObject out = new JsonObject();
        out.add("steps", steps);
        return out;
    }

    // ---- transactions -----------------------------------------------------------------------------------
    static JsonObject transaction(JsonObject args) throws Exception {
        TransactionMQProducer p = new TransactionMQProducer(args.get("group").getAsString());
        configure(p, args);
        JsonObject outcomes = args.getAsJsonObject("outcomes");   // keys -> COMMIT_MESSAGE | ROLLBACK_MESSAGE | UNKNOW
        JsonObject checks = args.getAsJsonObject("checks");       // keys -> the answer to a check-back
        JsonArray checked = new JsonArray();
        // the keys whose first check-back ends the wait (a broker may also check a decided one again)
        java.util.Set<String> awaited = java.util.concurrent.ConcurrentHashMap.newKeySet();
        if (args.has("awaitChecks")) {
            args.getAsJsonArray("awaitChecks").forEach(k -> awaited.add(k.getAsString()));
        }
        CountDownLatch checksDone = new CountDownLatch(awaited.size());
        // the client answers a check-back from this executor's task, after checkLocalTransaction returns:
        // its tasks are let end before the producer shuts down, or the last answer may never be sent
        java.util.concurrent.ExecutorService checkExecutor =
            java.util.concurrent.Executors.newSingleThreadExecutor();
        p.setExecutorService(checkExecutor);
        p.setTransactionListener(new TransactionListener() {
            public LocalTransactionState executeLocalTransaction(Message msg, Object arg) {
                return LocalTransactionState.valueOf(outcomes.get(msg.getKeys()).getAsString());
            }

            public LocalTransactionState checkLocalTransaction(MessageExt msg) {
                synchronized (checked) {
                    checked.add(msg.getKeys());
                }
                if (awaited.remove(msg.getKeys())) {
                    checksDone.countDown();
                }
                JsonElement a = checks.get(msg.getKeys());
                return a == null ? LocalTransactionState.UNKNOW : LocalTransactionState.valueOf(a.getAsString());
            }
        });
        p.start();
        JsonArray results = new JsonArray();
        try {
            for (JsonElement e : args.getAsJsonArray("messages")) {
                try {
                    TransactionSendResult r = p.sendMessageInTransaction(message(e.getAsJsonObject()), null);
                    JsonObject o = sent(r);
                    o.addProperty("localState", r.getLocalTransactionState().name());
                    results.add(o);
                } catch (Exception ex) {
                    results.add(failed(ex));
                }
            }
            checksDone.await(num(args, "checkWaitSeconds", 0), TimeUnit.SECONDS);
            checkExecutor.shutdown();
            checkExecutor.awaitTermination(10, TimeUnit.SECONDS);
        } finally {
            p.shutdown();
            checkExecutor.shutdownNow();
        }
        JsonObject out = new JsonObject();
        out.add("results", results);
        synchronized (checked) {
            out.add("checked", checked);
        }
        return out;
    }

    // ---- request-reply ----------------------------------------------------------------------------------
    static JsonObject requestReply(JsonObject args) throws Exception {
        String namesrv = args.get("namesrv").getAsString();
        String topic = args.get("topic").getAsString();
        DefaultMQProducer replier = configure(new DefaultMQProducer(args.get("group").getAsString() + "_R"), args);
        replier.setInstanceName(instance("replier"));
        DefaultMQPushConsumer c = new DefaultMQPushConsumer(args.get("group").getAsString());
        c.setNamesrvAddr(namesrv);
        c.setInstanceName(instance("replier"));
        tls(c, args);
        c.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET);
        c.subscribe(topic, "*");
        c.registerMessageListener((MessageListenerConcurrently) (ms, ctx) -> {
            for (MessageExt m : ms) {
                try {
                    Message reply = MessageUtil.createReplyMessage(m,
                        ("re:" + new String(m.getBody(), StandardCharsets.UTF_8)).getBytes(StandardCharsets.UTF_8));
                    replier.send(reply, 5000);
                } catch (Exception e) {
                    System.err.println("reply failed: " + e);
                }
            }
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
        });
        DefaultMQProducer requester = configure(new DefaultMQProducer(args.get("group").getAsString() + "_Q"), args);
        JsonArray results = new JsonArray();
        try {  // shutting down a client that did not start does nothing
            replier.start();
            c.start();
            requester.start();
            for (JsonElement e : args.getAsJsonArray("bodies")) {
                Message m = new Message(topic, e.getAsString().getBytes(StandardCharsets.UTF_8));
                JsonObject o = new JsonObject();
                long deadline = System.currentTimeMillis() + num(args, "waitMs", 30000);
                while (true) {  // the replier's subscription may not be routed yet: a request can time out
                    try {
                        Message reply = requester.request(m, num(args, "requestTimeoutMs", 3000));
                        o.addProperty("ok", true);
                        o.addProperty("reply", new String(reply.getBody(), StandardCharsets.UTF_8));
                        JsonObject props = new JsonObject();
                        reply.getProperties().forEach(props::addProperty);
                        o.add("props", props);
                        break;
                    } catch (Exception ex) {
                        if (System.currentTimeMillis() > deadline) {
                            o = failed(ex);
                            break;
                        }
                    }
                }
                results.add(o);
            }
        } finally {
            requester.shutdown();
            c.shutdown();
            replier.shutdown();
        }
        JsonObject out = new JsonObject();
        out.add("results", results);
        return out;
    }

    // ---- lite pull consumer with seek -------------------------------------------------------------------
    static JsonObject litePull(JsonObject args) throws Exception {
        DefaultLitePullConsumer c = new DefaultLitePullConsumer(args.get("group").getAsString());
        c.setNamesrvAddr(args.get("namesrv").getAsString());
        c.setInstanceName(instance("driver"));
        c.setVipChannelEnabled(false);
        tls(c, args);
        c.setAutoCommit(false);
        c.setPollTimeoutMillis(500);
        c.start();
        List<MessageQueue> queues;
        JsonArray got = new JsonArray();
        JsonArray early = new JsonArray();
        JsonObject committed = new JsonObject();
        try {
            String topic = args.get("topic").getAsString();
            queues = new ArrayList<>(c.fetchMessageQueues(topic));
            queues.sort(java.util.Comparator.comparingInt(MessageQueue::getQueueId));
            c.assign(queues);
            long deadline = System.currentTimeMillis() + num(args, "maxSeconds", 30) * 1000;
            // assign() starts a pull task at once, and seek() replaces it; a pull of the first task that
            // returns while seek() runs can still be handed to poll() (the client's own race): with
            // "before", the first task's messages are polled first, so that no pull of it is in flight.
            // seek() sets only the next pull's offset: if that pull fails (the old task's interrupt can hit
            // the pool thread that runs the new one), the task goes on from the first task's offset, past
            // messages that seek() dropped from the cache
            int before = (int) num(args, "before", 0);
            while (early.size() < before && System.currentTimeMillis() < deadline) {
                for (MessageExt m : c.poll()) {
                    early.add(describe(m, System.currentTimeMillis()));
                }
            }
            // without "seek" the consumer reads from where its group starts (a new group: offset 0)
            if (args.has("seek")) {
                long seek = num(args, "seek", 0);
                for (MessageQueue q : queues) {
                    c.seek(q, seek);
                }
            }
            int expect = (int) num(args, "expect", 1);
            while (got.size() < expect && System.currentTimeMillis() < deadline) {
                for (MessageExt m : c.poll()) {
                    got.add(describe(m, System.currentTimeMillis()));
                }
            }
            if (flag(args, "commit")) {
                c.commitSync();
                for (MessageQueue q : queues) {
                    committed.addProperty(String.valueOf(q.getQueueId()), c.committed(q));
                }
            }
        } finally {
            c.shutdown();
        }
        JsonObject out = new JsonObject();
        out.addProperty("queues", queues.size());
        out.add("messages", got);
        out.add("before_seek", early);
        out.add("committed", committed);
        return out;
    }

    private Driver() {
    }
}
