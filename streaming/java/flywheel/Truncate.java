package flywheel;

import java.util.Arrays;

import org.apache.flink.table.functions.ScalarFunction;

/** The first `limit` bytes of a record: what a dead letter keeps of an oversized payload. */
public class Truncate extends ScalarFunction {
    public byte[] eval(byte[] payload, Integer limit) {
        return payload == null || payload.length <= limit ? payload : Arrays.copyOf(payload, limit);
    }
}
