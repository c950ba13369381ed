package flywheel;

import org.apache.flink.table.functions.ScalarFunction;

/** The size of a record in bytes (Flink SQL has no OCTET_LENGTH for BYTES). */
public class ByteLength extends ScalarFunction {
    public Integer eval(byte[] payload) {
        return payload == null ? null : payload.length;
    }
}
