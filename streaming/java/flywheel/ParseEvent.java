package flywheel;

import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeSet;

import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.core.json.JsonReadFeature;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.JsonNode;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.ObjectMapper;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.json.JsonMapper;
import org.apache.flink.table.annotation.DataTypeHint;
import org.apache.flink.table.annotation.FunctionHint;
import org.apache.flink.table.data.GenericRowData;
import org.apache.flink.table.data.RowData;
import org.apache.flink.table.data.StringData;
import org.apache.flink.table.functions.FunctionContext;
import org.apache.flink.table.functions.TableFunction;

/**
 * The behavior-event schema of streaming/events.py, checked in the JVM: one parse per record, the same
 * rules in the same order and the same reasons, so the stream job and the Python clients agree on what is
 * valid. Emits one row per record: (reason, event_id, user_id, item_id, event_type, event_time, category, keys);
 * reason is null for a valid event, and the other fields are null for an invalid one. category is the value of
 * the spec's first key, keys those of the others joined by KEYS_SEPARATOR (MISSING_KEY for a missing one: no
 * value is empty, whatever a splitter does with empty ones). An event whose
 * context lacks a key takes the item's from the catalog (ItemKeys).
 * tests/test_stream_features.py compares its reasons with streaming.events.decode on a corpus of junk.
 * Rows are emitted in Flink's internal format (RowData): no conversion per record.
 */
@FunctionHint(output = @DataTypeHint(value =
        "ROW<reason STRING, event_id STRING, user_id STRING, item_id STRING, event_type STRING,"
        + " event_time BIGINT, category STRING, keys STRING>", bridgedTo = RowData.class))
public class ParseEvent extends TableFunction<RowData> {
    // Kept in step with streaming/events.py.
    static final int SCHEMA_VERSION = 1;
    static final int MAX_ID_CHARS = 128;
    static final int MAX_CONTEXT_KEYS = 32;
    static final long MIN_EVENT_TIME_MS = 0L;
    static final long MAX_EVENT_TIME_MS = 4_102_444_800_000L;
    static final String[] STRING_FIELDS = {"event_id", "user_id", "item_id", "request_id"};
    /** Job parameter: the dataset spec's event types, '|'-separated (streaming/job.py sets it). */
    static final String EVENT_TYPES = "flywheel.event-types";
    /** The context fields whose values are the event's keys (the spec's `[events] key`: the item's category
     * first), '|'-separated. */
    static final String KEY_FIELD = "flywheel.key-field";
    /** Between the values of the keys after the first (streaming/job.py splits them). */
    static final char KEYS_SEPARATOR = '\u001f';
    static final char MISSING_KEY = '\u001e';
    /** The file of the catalog's item keys, for events without the key (ItemKeys; empty: none). */
    static final String ITEM_KEYS = "flywheel.item-keys";
    /** Each key's value for an event that carries none and whose item has none in the catalog, '|'-separated in the
     * keys' order (empty: none; a context key's declared default, as a request without it is read). */
    static final String KEY_DEFAULTS = "flywheel.key-defaults";
    static final Set<String> FIELDS = new TreeSet<>(List.of(
            "schema_version", "event_type", "event_time", "context", "event_id", "user_id", "item_id", "request_id"));

    // Python's json module accepts NaN and Infinity; so does this parser.
    private static final ObjectMapper JSON = JsonMapper.builder()
            .enable(JsonReadFeature.ALLOW_NON_NUMERIC_NUMBERS).build();

    private List<String> types;
    private List<String> keyFields;
    private List<String> keyDefaults;
    private transient ItemKeys itemKeys;  // opened on the task: not part of the serialized function

    @Override
    public void open(FunctionContext context) {
        types = jobList(context, EVENT_TYPES);
        keyFields = jobList(context, KEY_FIELD);
        keyDefaults = List.of(context.getJobParameter(KEY_DEFAULTS, "").split("\\|", -1));
        itemKeys = new ItemKeys(context.getJobParameter(ITEM_KEYS, ""));
    }

    /** A '|'-separated list the job must pass (the dataset spec's vocabulary: no default here). */
    static List<String> jobList(FunctionContext context, String key) {
        String value = context.getJobParameter(key, null);
        if (value == null || value.isEmpty()) {
            throw new IllegalStateException("job parameter " + key + " is not set (pipeline.global-job-parameters)");
        }
        return List.of(value.split("\\|"));
    }

    public void eval(byte[] payload, Integer maxBytes) {
        String reason;
        try {
            collect(parse(payload, maxBytes, types, keyFields, keyDefaults, itemKeys));
            return;
        } catch (Invalid e) {
            reason = e.getMessage();
        }
        collect(GenericRowData.of(StringData.fromString(reason), null, null, null, null, null, null, null));
    }

    static final class Invalid extends Exception {
        Invalid(String reason) {
            super(reason, null, false, false);
        }
    }

    static RowData parse(byte[] payload, int maxBytes, List<String> types, List<String> keyFields,
                         List<String> keyDefaults, ItemKeys itemKeys) throws Invalid {
        if (payload == null) {
            throw new Invalid("empty record (null value)");
        }
        if (payload.length > maxBytes) {
            throw new Invalid("oversized: " + payload.length + " bytes (limit " + maxBytes + ")");
        }
        JsonNode record;
        try {
            record = JSON.readTree(payload);
        } catch (Exception e) {
            throw new Invalid("malformed JSON: " + e.getMessage().split("\n")[0]);
        }
        if (record == null || record.isMissingNode()) {
            throw new Invalid("malformed JSON: no value");
        }
        if (!record.isObject()) {
            throw new Invalid("not a JSON object: got " + typeName(record));
        }
        if (!hasExactlyTheFields(record)) {
            Set<String> keys = new TreeSet<>();
            record.fieldNames().forEachRemaining(keys::add);
            Set<String> missing = new TreeSet<>(FIELDS);
            missing.removeAll(keys);
            if (!missing.isEmpty()) {
                throw new Invalid("missing field(s): " + String.join(", ", missing));
            }
            keys.removeAll(FIELDS);
            throw new Invalid("unexpected field(s): " + String.join(", ", keys));
        }
        JsonNode version = record.get("schema_version");
        if (!isInt(version)) {
            throw new Invalid("wrong type: schema_version must be an integer, got " + typeName(version));
        }
        if (!version.canConvertToLong() || version.asLong() != SCHEMA_VERSION) {
            throw new Invalid("unsupported schema_version " + version.asText() + " (this consumer reads "
                    + SCHEMA_VERSION + ")");
        }
        String[] strings = new String[STRING_FIELDS.length];
        for (int i = 0; i < STRING_FIELDS.length; i++) {
            JsonNode value = record.get(STRING_FIELDS[i]);
            if (!value.isTextual()) {
                throw new Invalid("wrong type: " + STRING_FIELDS[i] + " must be a string, got " + typeName(value));
            }
            String text = value.textValue();
            int chars = text.codePointCount(0, text.length());
            if (chars == 0 || chars > MAX_ID_CHARS) {
                throw new Invalid("bad value: " + STRING_FIELDS[i] + " must have 1.." + MAX_ID_CHARS + " characters");
            }
            strings[i] = text;
        }
        JsonNode type = record.get("event_type");
        if (!type.isTextual() || !types.contains(type.textValue())) {
            throw new Invalid("unknown event_type " + repr(type) + " (declared: " + String.join(", ", types) + ")");
        }
        JsonNode time = record.get("event_time");
        if (!isInt(time)) {
            throw new Invalid("wrong type: event_time must be integer milliseconds, got " + typeName(time));
        }
        if (!time.canConvertToLong() || time.asLong() < MIN_EVENT_TIME_MS || time.asLong() > MAX_EVENT_TIME_MS) {
            throw new Invalid("bad value: event_time " + time.asText()
                    + " is not milliseconds between 1970 and 2100");
        }
        JsonNode context = record.get("context");
        if (!context.isObject()) {
            throw new Invalid("wrong type: context must be an object, got " + typeName(context));
        }
        if (context.size() > MAX_CONTEXT_KEYS) {
            throw new Invalid("bad value: context has " + context.size() + " keys (at most " + MAX_CONTEXT_KEYS + ")");
        }
        for (Map.Entry<String, JsonNode> entry : context.properties()) {
            JsonNode value = entry.getValue();
            if (!(value.isTextual() || value.isNumber() || value.isBoolean())) {
                throw new Invalid("wrong type: context[" + pyString(entry.getKey())
                        + "] must be a string, number or boolean, got " + typeName(value));
            }
        }
        String[] catalog = null;  // read once, for the first key an event lacks
        String categoryText = null;
        StringBuilder others = new StringBuilder();
        for (int k = 0; k < keyFields.size(); k++) {
            JsonNode carried = context.get(keyFields.get(k));
            String text = carried == null || (carried.isTextual() && carried.textValue().isEmpty())
                    ? null : carried.isBoolean() ? (carried.booleanValue() ? "True" : "False") : carried.asText();
            if (text == null) {  // not carried: the catalog's, as the replay does (streaming/history.py)
                catalog = catalog == null ? itemKeys.get(strings[2]) : catalog;
                text = k < catalog.length ? catalog[k] : null;
            }
            if (text == null && k < keyDefaults.size() && !keyDefaults.get(k).isEmpty()) {
                text = keyDefaults.get(k);
            }
            if (k == 0) {
                categoryText = text;
            } else {
                if (k > 1) others.append(KEYS_SEPARATOR);
                if (text == null) others.append(MISSING_KEY); else others.append(text);
            }
        }
        return GenericRowData.of(null, StringData.fromString(strings[0]), StringData.fromString(strings[1]),
                StringData.fromString(strings[2]), StringData.fromString(type.textValue()), time.asLong(),
                StringData.fromString(categoryText), StringData.fromString(others.toString()));
    }

    private static boolean hasExactlyTheFields(JsonNode record) {
        if (record.size() != FIELDS.size()) return false;
        for (String name : FIELDS) {
            if (!record.has(name)) return false;
        }
        return true;
    }

    /** Python's `type(x) is int`: an integral JSON number (not a float like 1.0, not a boolean). */
    private static boolean isInt(JsonNode node) {
        return node.isIntegralNumber();
    }

    /** The name Python gives the type of the decoded value. */
    static String typeName(JsonNode node) {
        if (node.isObject()) return "dict";
        if (node.isArray()) return "list";
        if (node.isTextual()) return "str";
        if (node.isBoolean()) return "bool";
        if (node.isNull()) return "NoneType";
        if (node.isIntegralNumber()) return "int";
        return "float";
    }

    /** Python's repr() of a decoded scalar, as the reasons of streaming/events.py quote it. */
    static String repr(JsonNode node) {
        if (node.isTextual()) return pyString(node.textValue());
        if (node.isBoolean()) return node.booleanValue() ? "True" : "False";
        if (node.isNull()) return "None";
        return node.toString();
    }

    private static String pyString(String text) {
        return text.contains("'") && !text.contains("\"") ? "\"" + text + "\"" : "'" + text.replace("'", "\\'") + "'";
    }
}
