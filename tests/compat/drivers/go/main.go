// Command godriver drives the official RocketMQ Go client (github.com/apache/rocketmq-client-go/v2)
// for the compat suite.
//
// Contract (the same as the Python drivers): argv[1] is one JSON object of arguments, the result is
// the last stdout line (JSON), errors go to stderr with a non-zero exit code. Streaming ops append one
// JSON line per event to args["out"]; SIGTERM/SIGINT make them shut the client down cleanly and print
// their result.
//
// Common args: op ("produce" | "push_consume"), namesrv ("127.0.0.1:PORT"), group.
//
// produce: messages: [{topic, body_b64 | body (text), tags, keys (string or list), props {k: v},
// delay_level}], timeout_ms (default 3000), retries (default 2). Sync sends, one at a time.
// Result: {"op", "sent", "acked", "results": [{index, status, msg_id, offset_msg_id, broker_name,
// queue_id, queue_offset} or {index, error}], "elapsed_ms"}.
//
// push_consume: topic, expression (tag expression, default "*"), out (JSONL path), max_seconds
// (default 60), retry_later_times (the first N deliveries of each message answer ConsumeRetryLater),
// expect (stop after this many successful consumptions, then settle_ms (default 500) once no callback
// runs, so the client has recorded the last offsets), from ("first" | "last", the client's
// ConsumeFromWhere; default "first"), max_reconsume_times, consume_goroutines.
// One line per delivery: msg_id, offset_msg_id, topic, queue_topic (the queue it was pulled from,
// %RETRY%group for a retry), queue_id, queue_offset, commit_log_offset, body_b64, tags, keys,
// properties (the whole map), reconsume_times, born_timestamp, store_timestamp, born_host, store_host,
// sys_flag, receipt_ms (the driver's clock), consumed (false when answered ConsumeRetryLater). Preceded by {"event": "started", "ms": ...}.
// Result: {"op", "consumed", "failed", "deliveries", "reason" (signal | max_seconds | expect),
// "started_ms", "stopped_ms"}.
package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/apache/rocketmq-client-go/v2"
	"github.com/apache/rocketmq-client-go/v2/consumer"
	"github.com/apache/rocketmq-client-go/v2/primitive"
	"github.com/apache/rocketmq-client-go/v2/producer"
	"github.com/apache/rocketmq-client-go/v2/rlog"
)

type messageSpec struct {
	Topic      string            `json:"topic"`
	BodyB64    *string           `json:"body_b64"`
	Body       *string           `json:"body"`
	Tags       string            `json:"tags"`
	Keys       json.RawMessage   `json:"keys"`
	Props      map[string]string `json:"props"`
	DelayLevel int               `json:"delay_level"`
}

type driverArgs struct {
	Op                string        `json:"op"`
	Namesrv           string        `json:"namesrv"`
	Group             string        `json:"group"`
	Messages          []messageSpec `json:"messages"`
	TimeoutMs         int           `json:"timeout_ms"`
	Retries           *int          `json:"retries"`
	Topic             string        `json:"topic"`
	Expression        string        `json:"expression"`
	Out               string        `json:"out"`
	MaxSeconds        float64       `json:"max_seconds"`
	RetryLaterTimes   int           `json:"retry_later_times"`
	Expect            int           `json:"expect"`
	From              string        `json:"from"`
	MaxReconsumeTimes *int32        `json:"max_reconsume_times"`
	ConsumeGoroutines int           `json:"consume_goroutines"`
	SettleMs          *int          `json:"settle_ms"`
}

func fail(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "driver error: "+format+"\n", a...)
	os.Exit(2)
}

func emit(result map[string]any) {
	line, err := json.Marshal(result)
	if err != nil {
		fail("cannot encode the result: %v", err)
	}
	os.Stdout.Write(append(line, '\n'))
}

func nowMs() int64 { return time.Now().UnixMilli() }

// jsonlWriter appends whole JSON lines, one write and flush per line, from any goroutine.
type jsonlWriter struct {
	mu sync.Mutex
	f  *os.File
}

func newJsonlWriter(path string) *jsonlWriter {
	if path == "" {
		return &jsonlWriter{}
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fail("cannot open out %s: %v", path, err)
	}
	return &jsonlWriter{f: f}
}

func (w *jsonlWriter) write(obj map[string]any) {
	line, err := json.Marshal(obj)
	if err != nil {
		fmt.Fprintf(os.Stderr, "cannot encode a record: %v\n", err)
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.f != nil { // nil: no out, or closed after shutdown
		w.f.Write(append(line, '\n'))
	}
}

func (w *jsonlWriter) close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.f != nil {
		w.f.Close()
		w.f = nil
	}
}

func keysOf(raw json.RawMessage) ([]string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var one string
	if err := json.Unmarshal(raw, &one); err == nil {
		if one == "" {
			return nil, nil
		}
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, fmt.Errorf("keys must be a string or a list of strings: %s", raw)
	}
	return many, nil
}

func buildMessage(spec messageSpec) (*primitive.Message, error) {
	if spec.Topic == "" {
		return nil, fmt.Errorf("a message needs a topic")
	}
	var body []byte
	switch {
	case spec.BodyB64 != nil:
		b, err := base64.StdEncoding.DecodeString(*spec.BodyB64)
		if err != nil {
			return nil, fmt.Errorf("body_b64: %v", err)
		}
		body = b
	case spec.Body != nil:
		body = []byte(*spec.Body)
	default:
		return nil, fmt.Errorf("a message needs body_b64 or body")
	}
	msg := primitive.NewMessage(spec.Topic, body)
	if spec.Tags != "" {
		msg.WithTag(spec.Tags)
	}
	keys, err := keysOf(spec.Keys)
	if err != nil {
		return nil, err
	}
	if len(keys) > 0 {
		msg.WithKeys(keys)
	}
	for k, v := range spec.Props {
		msg.WithProperty(k, v)
	}
	if spec.DelayLevel > 0 {
		msg.WithDelayTimeLevel(spec.DelayLevel)
	}
	return msg, nil
}

func sendStatus(s primitive.SendStatus) string {
	switch s {
	case primitive.SendOK:
		return "SEND_OK"
	case primitive.SendFlushDiskTimeout:
		return "FLUSH_DISK_TIMEOUT"
	case primitive.SendFlushSlaveTimeout:
		return "FLUSH_SLAVE_TIMEOUT"
	case primitive.SendSlaveNotAvailable:
		return "SLAVE_NOT_AVAILABLE"
	default:
		return fmt.Sprintf("UNKNOWN(%d)", int(s))
	}
}

func produce(args driverArgs) {
	group := args.Group
	if group == "" {
		group = "PG_go_compat"
	}
	timeout := 3000
	if args.TimeoutMs > 0 {
		timeout = args.TimeoutMs
	}
	retries := 2
	if args.Retries != nil {
		retries = *args.Retries
	}
	p, err := rocketmq.NewProducer(
		producer.WithNameServer([]string{args.Namesrv}),
		producer.WithGroupName(group),
		producer.WithSendMsgTimeout(time.Duration(timeout)*time.Millisecond),
		producer.WithRetry(retries),
	)
	if err != nil {
		fail("new producer: %v", err)
	}
	if err := p.Start(); err != nil {
		fail("producer start: %v", err)
	}
	begin := time.Now()
	results := make([]map[string]any, 0, len(args.Messages))
	acked := 0
	for i, spec := range args.Messages {
		msg, err := buildMessage(spec)
		if err != nil {
			p.Shutdown()
			fail("message %d: %v", i, err)
		}
		res, err := p.SendSync(context.Background(), msg)
		if err != nil {
			results = append(results, map[string]any{"index": i, "error": err.Error()})
			continue
		}
		r := map[string]any{"index": i, "status": sendStatus(res.Status), "msg_id": res.MsgID,
			"offset_msg_id": res.OffsetMsgID, "queue_offset": res.QueueOffset}
		if res.MessageQueue != nil {
			r["broker_name"] = res.MessageQueue.BrokerName
			r["queue_id"] = res.MessageQueue.QueueId
		}
		if res.Status == primitive.SendOK {
			acked++
		}
		results = append(results, r)
	}
	elapsed := time.Since(begin).Milliseconds()
	if err := p.Shutdown(); err != nil {
		fmt.Fprintf(os.Stderr, "producer shutdown: %v\n", err)
	}
	emit(map[string]any{"op": "produce", "sent": len(args.Messages), "acked": acked, "results": results,
		"elapsed_ms": elapsed})
}

func deliveryRecord(msg *primitive.MessageExt, consumed bool) map[string]any {
	queueTopic, queueID := "", -1
	if msg.Queue != nil {
		queueTopic, queueID = msg.Queue.Topic, msg.Queue.QueueId
	}
	return map[string]any{
		"msg_id": msg.MsgId, "offset_msg_id": msg.OffsetMsgId, "topic": msg.Topic,
		"queue_topic": queueTopic, "queue_id": queueID, "queue_offset": msg.QueueOffset,
		"commit_log_offset": msg.CommitLogOffset, "body_b64": base64.StdEncoding.EncodeToString(msg.Body),
		"tags": msg.GetTags(), "keys": msg.GetKeys(), "properties": msg.GetProperties(),
		"reconsume_times": msg.ReconsumeTimes, "born_timestamp": msg.BornTimestamp,
		"store_timestamp": msg.StoreTimestamp, "born_host": msg.BornHost, "store_host": msg.StoreHost,
		"sys_flag": msg.SysFlag, "receipt_ms": nowMs(), "consumed": consumed,
	}
}

func pushConsume(args driverArgs) {
	if args.Topic == "" || args.Group == "" {
		fail("push_consume needs topic and group")
	}
	expression := args.Expression
	if expression == "" {
		expression = "*"
	}
	maxSeconds := args.MaxSeconds
	if maxSeconds <= 0 {
		maxSeconds = 60
	}
	from := consumer.ConsumeFromFirstOffset
	switch args.From {
	case "", "first":
	case "last":
		from = consumer.ConsumeFromLastOffset
	default:
		fail("from must be first or last, not %q", args.From)
	}
	opts := []consumer.Option{
		consumer.WithNameServer([]string{args.Namesrv}),
		consumer.WithGroupName(args.Group),
		consumer.WithConsumerModel(consumer.Clustering),
		consumer.WithConsumeFromWhere(from),
	}
	if args.MaxReconsumeTimes != nil {
		opts = append(opts, consumer.WithMaxReconsumeTimes(*args.MaxReconsumeTimes))
	}
	if args.ConsumeGoroutines > 0 {
		opts = append(opts, consumer.WithConsumeGoroutineNums(args.ConsumeGoroutines))
	}
	c, err := rocketmq.NewPushConsumer(opts...)
	if err != nil {
		fail("new push consumer: %v", err)
	}
	out := newJsonlWriter(args.Out)
	var mu sync.Mutex
	failures := map[string]int{}
	consumed, failed, inflight := 0, 0, 0
	reached := make(chan struct{})
	var reachedOnce sync.Once

	callback := func(_ context.Context, msgs ...*primitive.MessageExt) (consumer.ConsumeResult, error) {
		// the client hands over one message at a time by default (ConsumeMessageBatchMaxSize 1); with
		// more, one RetryLater applies to the whole batch, so the batch fails if any of them should
		retry := false
		mu.Lock()
		inflight++
		for _, msg := range msgs {
			if failures[msg.MsgId] < args.RetryLaterTimes {
				failures[msg.MsgId]++
				retry = true
			}
		}
		mu.Unlock()
		for _, msg := range msgs {
			out.write(deliveryRecord(msg, !retry))
		}
		mu.Lock()
		inflight--
		if retry {
			failed += len(msgs)
		} else {
			consumed += len(msgs)
			if args.Expect > 0 && consumed >= args.Expect {
				reachedOnce.Do(func() { close(reached) })
			}
		}
		mu.Unlock()
		if retry {
			return consumer.ConsumeRetryLater, nil
		}
		return consumer.ConsumeSuccess, nil
	}
	if err := c.Subscribe(args.Topic, consumer.MessageSelector{Type: consumer.TAG, Expression: expression},
		callback); err != nil {
		fail("subscribe: %v", err)
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	if err := c.Start(); err != nil {
		fail("push consumer start: %v", err)
	}
	started := nowMs()
	out.write(map[string]any{"event": "started", "ms": started})
	reason := "max_seconds"
	deadline := time.Now().Add(time.Duration(maxSeconds * float64(time.Second)))
	timer := time.NewTimer(time.Until(deadline))
	select {
	case <-sigs:
		reason = "signal"
	case <-reached:
		reason = "expect"
	case <-timer.C:
	}
	timer.Stop()
	if reason == "expect" {
		// let the last callbacks return and the client record their offsets before it shuts down
		settle := 500
		if args.SettleMs != nil {
			settle = *args.SettleMs
		}
		settleUntil := time.Now().Add(time.Duration(settle) * time.Millisecond)
		for time.Now().Before(deadline) {
			mu.Lock()
			idle := inflight == 0
			mu.Unlock()
			if idle && !time.Now().Before(settleUntil) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	if err := c.Shutdown(); err != nil {
		fmt.Fprintf(os.Stderr, "push consumer shutdown: %v\n", err)
	}
	stopped := nowMs()
	out.close()
	mu.Lock()
	defer mu.Unlock()
	emit(map[string]any{"op": "push_consume", "consumed": consumed, "failed": failed,
		"deliveries": consumed + failed, "reason": reason, "started_ms": started, "stopped_ms": stopped})
}

func main() {
	if len(os.Args) != 2 {
		fail("usage: godriver '<json object of arguments>'")
	}
	var args driverArgs
	dec := json.NewDecoder(strings.NewReader(os.Args[1]))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&args); err != nil {
		fail("argv[1] is not a JSON object of known arguments: %v", err)
	}
	if args.Namesrv == "" {
		fail("missing argument: namesrv")
	}
	// the client logs through logrus to stderr; only warnings and errors
	rlog.SetLogLevel("warn")
	switch args.Op {
	case "produce":
		produce(args)
	case "push_consume":
		pushConsume(args)
	default:
		fail("op must be produce or push_consume, not %q", args.Op)
	}
}
