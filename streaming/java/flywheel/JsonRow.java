package flywheel;

import java.nio.charset.StandardCharsets;

import org.apache.flink.table.annotation.DataTypeHint;
import org.apache.flink.table.annotation.InputGroup;
import org.apache.flink.table.functions.ScalarFunction;

/**
 * Its arguments as one JSON array (UTF-8): what a stream view's row carries to the ingestor, by
 * position, in the order streaming/features.py declares (`row_schema`). Written by hand: the Kafka
 * sink's JSON format builds a Jackson tree of named fields per row (profiled: a fifth of the job's CPU).
 * Strings, integers, doubles (a non-finite one as null, as JSON has none), arrays of them and null.
 */
public class JsonRow extends ScalarFunction {
    private final StringBuilder out = new StringBuilder(256);

    public byte[] eval(@DataTypeHint(inputGroup = InputGroup.ANY) Object... values) {
        out.setLength(0);
        array(values);
        return out.toString().getBytes(StandardCharsets.UTF_8);
    }

    private void array(Object[] values) {
        out.append('[');
        for (int i = 0; i < values.length; i++) {
            if (i > 0) {
                out.append(',');
            }
            value(values[i]);
        }
        out.append(']');
    }

    private void value(Object v) {
        if (v == null) {
            out.append("null");
        } else if (v instanceof String s) {
            string(s);
        } else if (v instanceof Double d) {
            if (Double.isFinite(d)) {
                out.append(d.doubleValue());
            } else {
                out.append("null");
            }
        } else if (v instanceof Long || v instanceof Integer) {
            out.append(v);
        } else if (v instanceof Object[] items) {
            array(items);
        } else {
            throw new IllegalArgumentException("no JSON form for " + v.getClass().getName());
        }
    }

    private void string(String s) {
        out.append('"');
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            if (c == '"' || c == '\\') {
                out.append('\\').append(c);
            } else if (c < 0x20) {
                out.append(String.format("\\u%04x", (int) c));
            } else {
                out.append(c);
            }
        }
        out.append('"');
    }
}
