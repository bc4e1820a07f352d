package chronomq.compat5;

import com.google.gson.Gson;
import com.google.gson.GsonBuilder;
import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import java.nio.ByteBuffer;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Base64;
import java.util.Collections;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.apache.rocketmq.client.apis.ClientConfiguration;
import org.apache.rocketmq.client.apis.ClientConfigurationBuilder;
import org.apache.rocketmq.client.apis.StaticSessionCredentialsProvider;
import org.apache.rocketmq.client.apis.ClientException;
import org.apache.rocketmq.client.apis.ClientServiceProvider;
import org.apache.rocketmq.client.apis.consumer.ConsumeResult;
import org.apache.rocketmq.client.apis.consumer.FilterExpression;
import org.apache.rocketmq.client.apis.consumer.FilterExpressionType;
import org.apache.rocketmq.client.apis.consumer.PushConsumer;
import org.apache.rocketmq.client.apis.consumer.SimpleConsumer;
import org.apache.rocketmq.client.apis.message.Message;
import org.apache.rocketmq.client.apis.message.MessageBuilder;
import org.apache.rocketmq.client.apis.message.MessageView;
import org.apache.rocketmq.client.apis.producer.Producer;
import org.apache.rocketmq.client.apis.producer.ProducerBuilder;
import org.apache.rocketmq.client.apis.producer.SendReceipt;
import org.apache.rocketmq.client.apis.producer.Transaction;
import org.apache.rocketmq.client.apis.producer.TransactionResolution;

/**
 * A compatibility driver on the official RocketMQ 5.x Java client (rocketmq-client-java, gRPC). One JSON
 * object on argv[0]; the result is the last stdout line, in JSON. With argv "serve" the JVM runs requests
 * from stdin side by side instead (serve, below; each client has a client id of its own). The client runs
 * with its defaults (TLS on, as ClientConfiguration has it) unless args.ssl is false, and signs its calls with
 * args.accessKey and args.secretKey when given. Errors the client raises are reported as
 * {"type": exceptionClass, "code": the response code in the message or -1, "message": ...}.
 */
public final class Driver5 {
    static final Gson GSON = new GsonBuilder().disableHtmlEscaping().serializeNulls().create();
    static final Pattern RESPONSE_CODE = Pattern.compile("response-code=(\\d+)");
    static final ClientServiceProvider PROVIDER = ClientServiceProvider.loadService();

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
        Runtime.getRuntime().halt(0);  // client threads (grpc, netty, schedulers) need not linger
    }

    static JsonObject run(JsonObject args) throws Exception {
        String op = args.get("op").getAsString();
        switch (op) {
            case "produce": return produce(args);
            case "simple_consume": return simpleConsume(args);
            case "push_consume": return pushConsume(args);
            case "status": return status();
            default: throw new IllegalArgumentException("unknown op " + op);
        }
    }

    /**
     * The serve mode (argv: serve), as Driver's: one JSON request per stdin line, {"id": n, "op": ..., the
     * op's args}, each on a thread of its own; one line per request on stdout, under a lock: {"id": n,
     * "result": {...}} or {"id": n, "error": {"type", "code", "message", "stack"}}. Every op closes its
     * clients before it answers. The JVM halts when stdin closes.
     */
    static void serve(java.io.PrintStream answers) throws java.io.IOException {
        java.io.BufferedReader in = new java.io.BufferedReader(
            new java.io.InputStreamReader(System.in, java.nio.charset.StandardCharsets.UTF_8));
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

    static Map<String, String> strMap(JsonObject o, String k) {
        Map<String, String> out = new HashMap<>();
        if (o.has(k) && o.get(k).isJsonObject()) {
            for (Map.Entry<String, JsonElement> e : o.getAsJsonObject(k).entrySet()) {
                out.put(e.getKey(), e.getValue().getAsString());
            }
        }
        return out;
    }

    static JsonObject error(Throwable t) {
        while (t.getCause() != null && !(t instanceof ClientException)) {
            t = t.getCause();
        }
        JsonObject e = new JsonObject();
        e.addProperty("type", t.getClass().getSimpleName());
        String message = String.valueOf(t.getMessage());
        Matcher m = RESPONSE_CODE.matcher(message);
        e.addProperty("code", m.find() ? Integer.parseInt(m.group(1)) : -1);
        e.addProperty("message", message);
        return e;
    }

    static ClientConfiguration config(JsonObject args) {
        ClientConfigurationBuilder b = ClientConfiguration.newBuilder()
            .setEndpoints(args.get("endpoint").getAsString())
            .enableSsl(!args.has("ssl") || args.get("ssl").getAsBoolean())
            .setRequestTimeout(Duration.ofMillis(num(args, "requestTimeoutMs", 10_000)));
        if (args.has("accessKey")) {
            b.setCredentialProvider(new StaticSessionCredentialsProvider(str(args, "accessKey", ""),
                str(args, "secretKey", "")));
        }
        return b.build();
    }

    static JsonObject view(MessageView v, Set<String> keysOf) {
        JsonObject r = new JsonObject();
        r.addProperty("messageId", v.getMessageId().toString());
        r.addProperty("topic", v.getTopic());
        ByteBuffer body = v.getBody().duplicate();
        byte[] bytes = new byte[body.remaining()];
        body.get(bytes);
        r.addProperty("body", Base64.getEncoder().encodeToString(bytes));
        r.addProperty("tag", v.getTag().orElse(null));
        JsonArray keys = new JsonArray();
        List<String> sorted = new ArrayList<>(v.getKeys());
        Collections.sort(sorted);
        for (String k : sorted) {
            keys.add(k);
        }
        r.add("keys", keys);
        r.add("props", GSON.toJsonTree(v.getProperties()));
        r.addProperty("deliveryAttempt", v.getDeliveryAttempt());
        r.addProperty("deliveryTimestamp", v.getDeliveryTimestamp().orElse(null));
        r.addProperty("messageGroup", v.getMessageGroup().orElse(null));
        r.addProperty("bornTimestamp", v.getBornTimestamp());
        r.addProperty("receivedAt", System.currentTimeMillis());
        return r;
    }

    static String firstKey(MessageView v) {
        return v.getKeys().isEmpty() ? "" : v.getKeys().iterator().next();
    }

    // ---- produce ----------------------------------------------------------------------------------------
    /**
     * args: endpoint, topics (declared to the producer), messages [{topic, body (b64) | bodySize, tag, keys,
     * props, group, deliveryTimestamp | deliveryDelayMs (from the moment of sending), tx: "commit" | "rollback" | "none" (send in a transaction and leave
     * it to the check)}], check {key: COMMIT | ROLLBACK | UNKNOWN} (the TransactionChecker's answers),
     * expectChecks / maxSeconds: wait until that many checks were answered; awaitChecks [key]: wait until
     * each of those keys was checked (a broker may check other half messages first, or again).
     */
    static JsonObject produce(JsonObject args) throws Exception {
        Map<String, String> answers = strMap(args, "check");
        List<JsonObject> checks = Collections.synchronizedList(new ArrayList<>());
        ProducerBuilder builder = PROVIDER.newProducerBuilder().setClientConfiguration(config(args));
        if (args.has("topics")) {
            List<String> topics = new ArrayList<>();
            for (JsonElement t : args.getAsJsonArray("topics")) {
                topics.add(t.getAsString());
            }
            builder.setTopics(topics.toArray(new String[0]));
        }
        builder.setTransactionChecker(v -> {
            String answer = answers.getOrDefault(firstKey(v), "UNKNOWN");
            JsonObject c = new JsonObject();
            c.addProperty("key", firstKey(v));
            c.addProperty("messageId", v.getMessageId().toString());
            c.addProperty("answer", answer);
            c.addProperty("at", System.currentTimeMillis());
            checks.add(c);
            return TransactionResolution.valueOf(answer);
        });
        JsonObject result = new JsonObject();
        JsonArray results = new JsonArray();
        Producer producer;
        try {
            producer = builder.build();
        } catch (Throwable t) {
            result.add("startError", error(t));
            result.add("results", results);
            return result;
        }
        try {
            sendAll(producer, args.getAsJsonArray("messages"), results);
            awaitChecks(args, checks);
            result.add("results", results);
            synchronized (checks) {
                result.add("checks", GSON.toJsonTree(checks));
            }
        } finally {
            producer.close();
        }
        return result;
    }

    static void sendAll(Producer producer, JsonArray messages, JsonArray results) {
        for (JsonElement el : messages) {
            JsonObject m = el.getAsJsonObject();
            JsonObject r = new JsonObject();
            try {
                MessageBuilder mb = PROVIDER.newMessageBuilder().setTopic(m.get("topic").getAsString());
                byte[] body = m.has("bodySize") ? new byte[(int) num(m, "bodySize", 0)]
                    : Base64.getDecoder().decode(str(m, "body", ""));
                mb.setBody(body);
                if (m.has("tag")) {
                    mb.setTag(m.get("tag").getAsString());
                }
                if (m.has("keys")) {
                    List<String> keys = new ArrayList<>();
                    for (JsonElement k : m.getAsJsonArray("keys")) {
                        keys.add(k.getAsString());
                    }
                    mb.setKeys(keys.toArray(new String[0]));
                }
                for (Map.Entry<String, String> p : strMap(m, "props").entrySet()) {
                    mb.addProperty(p.getKey(), p.getValue());
                }
                if (m.has("group")) {
                    mb.setMessageGroup(m.get("group").getAsString());
                }
                if (m.has("deliveryTimestamp")) {
                    mb.setDeliveryTimestamp(num(m, "deliveryTimestamp", 0));
                    r.addProperty("deliveryTimestamp", num(m, "deliveryTimestamp", 0));
                } else if (m.has("deliveryDelayMs")) {  // from now, when the message is built
                    long at = System.currentTimeMillis() + num(m, "deliveryDelayMs", 0);
                    mb.setDeliveryTimestamp(at);
                    r.addProperty("deliveryTimestamp", at);
                }
                Message msg = mb.build();
                String tx = str(m, "tx", null);
                SendReceipt receipt;
                r.addProperty("sentAt", System.currentTimeMillis());
                if (tx == null) {
                    receipt = producer.send(msg);
                } else {
                    Transaction t = producer.beginTransaction();
                    receipt = producer.send(msg, t);
                    if (tx.equals("commit")) {
                        t.commit();
                    } else if (tx.equals("rollback")) {
                        t.rollback();
                    }
                }
                r.addProperty("ok", true);
                r.addProperty("messageId", receipt.getMessageId().toString());
            } catch (Throwable t) {
                r.addProperty("ok", false);
                r.add("error", error(t));
            }
            results.add(r);
        }
    }

    /** Until expectChecks checks were answered and every key of awaitChecks was checked, or maxSeconds. */
    static void awaitChecks(JsonObject args, List<JsonObject> checks) throws InterruptedException {
        long expectChecks = num(args, "expectChecks", 0);
        long deadline = System.currentTimeMillis() + num(args, "maxSeconds", 60) * 1000;
        Set<String> awaited = new HashSet<>();
        if (args.has("awaitChecks")) {
            args.getAsJsonArray("awaitChecks").forEach(k -> awaited.add(k.getAsString()));
        }
        while (System.currentTimeMillis() < deadline) {
            Set<String> seen = new HashSet<>();
            synchronized (checks) {
                checks.forEach(c -> seen.add(c.get("key").getAsString()));
            }
            if (checks.size() >= expectChecks && seen.containsAll(awaited)) {
                break;
            }
            Thread.sleep(50);
        }
    }

    // ---- simple_consume ---------------------------------------------------------------------------------
    /**
     * args: endpoint, group, topic, filter (tag expression, "*"; a SQL92 one with filterType SQL92), expect
     * (messages to ack), invisibleMs,
     * awaitMs (long polling), batch, change {key: invisibleMs} (the first receipt of that key is not acked but
     * its invisible duration changed, so it comes back), maxSeconds, lingerMs (keep receiving that long after
     * the expected acks). One record per receipt, with "action"
     * (ack / change) and the outcome.
     */
    static JsonObject simpleConsume(JsonObject args) throws Exception {
        String topic = args.get("topic").getAsString();
        FilterExpression filter = new FilterExpression(str(args, "filter", "*"),
            FilterExpressionType.valueOf(str(args, "filterType", "TAG")));
        JsonObject result = new JsonObject();
        SimpleConsumer consumer;
        try {
            consumer = PROVIDER.newSimpleConsumerBuilder().setClientConfiguration(config(args))
                .setConsumerGroup(args.get("group").getAsString())
                .setAwaitDuration(Duration.ofMillis(num(args, "awaitMs", 2000)))
                .setSubscriptionExpressions(Collections.singletonMap(topic, filter))
                .build();
        } catch (Throwable t) {
            result.add("startError", error(t));
            result.add("records", new JsonArray());
            return result;
        }
        try {
            receiveAll(consumer, args, result);
        } finally {
            consumer.close();
        }
        return result;
    }

    static void receiveAll(SimpleConsumer consumer, JsonObject args, JsonObject result) throws InterruptedException {
        Map<String, String> change = strMap(args, "change");
        Set<String> changed = ConcurrentHashMap.newKeySet();
        JsonArray records = new JsonArray();
        long expect = num(args, "expect", 1);
        Duration invisible = Duration.ofMillis(num(args, "invisibleMs", 15_000));
        long deadline = System.currentTimeMillis() + num(args, "maxSeconds", 60) * 1000;
        long linger = num(args, "lingerMs", 0);  // a bounded look for receipts beyond the expected ones
        long doneAt = expect > 0 ? Long.MAX_VALUE : System.currentTimeMillis();
        int acked = 0;
        JsonArray receiveErrors = new JsonArray();
        if (args.has("out")) {  // the consumer is built (route and settings known): the receives start now
            try {
                java.nio.file.Files.writeString(java.nio.file.Path.of(args.get("out").getAsString()),
                    "{\"event\":\"receiving\"}\n", java.nio.file.StandardOpenOption.CREATE,
                    java.nio.file.StandardOpenOption.APPEND);
            } catch (java.io.IOException e) {
                receiveErrors.add(error(e));
            }
        }
        while (System.currentTimeMillis() < deadline
               && (doneAt == Long.MAX_VALUE || System.currentTimeMillis() < doneAt + linger)) {
            List<MessageView> got;
            try {
                got = consumer.receive((int) num(args, "batch", 16), invisible);
            } catch (Throwable t) {
                receiveErrors.add(error(t));
                if (receiveErrors.size() > 50) {
                    break;
                }
                Thread.sleep(200);
                continue;
            }
            for (MessageView v : got) {
                JsonObject r = view(v, null);
                String key = firstKey(v);
                try {
                    if (change.containsKey(key) && changed.add(key)) {
                        r.addProperty("action", "change");
                        consumer.changeInvisibleDuration(v, Duration.ofMillis(Long.parseLong(change.get(key))));
                    } else {
                        r.addProperty("action", "ack");
                        consumer.ack(v);
                        if (++acked >= expect && doneAt == Long.MAX_VALUE) {
                            doneAt = System.currentTimeMillis();
                        }
                    }
                    r.addProperty("ok", true);
                } catch (Throwable t) {
                    r.addProperty("ok", false);
                    r.add("error", error(t));
                }
                records.add(r);
            }
        }
        result.add("records", records);
        result.add("receiveErrors", receiveErrors);
        result.addProperty("acked", acked);
    }

    // ---- push_consume -----------------------------------------------------------------------------------
    /**
     * args: endpoint, group, topic, filter, expect (SUCCESS answers to wait for), fail [keys] (answered
     * FAILURE on their first delivery), maxSeconds. One record per delivery, with the listener's answer.
     */
    static JsonObject pushConsume(JsonObject args) throws Exception {
        Set<String> fail = ConcurrentHashMap.newKeySet();
        if (args.has("fail")) {
            for (JsonElement k : args.getAsJsonArray("fail")) {
                fail.add(k.getAsString());
            }
        }
        String topic = args.get("topic").getAsString();
        FilterExpression filter = new FilterExpression(str(args, "filter", "*"),
            FilterExpressionType.valueOf(str(args, "filterType", "TAG")));
        List<JsonObject> records = Collections.synchronizedList(new ArrayList<>());
        JsonObject result = new JsonObject();
        PushConsumer consumer;
        try {
            consumer = PROVIDER.newPushConsumerBuilder().setClientConfiguration(config(args))
                .setConsumerGroup(args.get("group").getAsString())
                .setSubscriptionExpressions(Collections.singletonMap(topic, filter))
                .setConsumptionThreadCount(2)
                .setMessageListener(v -> {
                    JsonObject r = view(v, null);
                    boolean failure = fail.remove(firstKey(v));
                    r.addProperty("answer", failure ? "FAILURE" : "SUCCESS");
                    records.add(r);
                    return failure ? ConsumeResult.FAILURE : ConsumeResult.SUCCESS;
                })
                .build();
        } catch (Throwable t) {
            result.add("startError", error(t));
            result.add("records", new JsonArray());
            return result;
        }
        try {
            long expect = num(args, "expect", 1);
            long deadline = System.currentTimeMillis() + num(args, "maxSeconds", 60) * 1000;
            while (System.currentTimeMillis() < deadline) {
                long ok;
                synchronized (records) {
                    ok = records.stream().filter(r -> r.get("answer").getAsString().equals("SUCCESS")).count();
                }
                if (ok >= expect) {
                    break;
                }
                Thread.sleep(50);
            }
            Thread.sleep(num(args, "lingerMs", 0));  // a bounded look for deliveries beyond the expected ones
            synchronized (records) {
                result.add("records", GSON.toJsonTree(records));
            }
        } finally {
            consumer.close();
        }
        return result;
    }
}
