package flywheel;

import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.connector.kafka.source.reader.deserializer.KafkaRecordDeserializationSchema;
import org.apache.flink.table.data.GenericRowData;
import org.apache.flink.table.data.RowData;
import org.apache.flink.table.data.StringData;
import org.apache.flink.table.runtime.typeutils.InternalTypeInfo;
import org.apache.flink.table.types.logical.BigIntType;
import org.apache.flink.table.types.logical.IntType;
import org.apache.flink.table.types.logical.LogicalType;
import org.apache.flink.table.types.logical.RowType;
import org.apache.flink.table.types.logical.VarBinaryType;
import org.apache.flink.table.types.logical.VarCharType;
import org.apache.flink.util.Collector;
import org.apache.kafka.clients.consumer.ConsumerRecord;

/**
 * A record of the events topic as the job's first table reads it: key, value, and where it was read from
 * (a dead letter names its topic, partition and offset). Flink's internal rows, so the table that reads
 * them converts nothing.
 */
public class EventRecords implements KafkaRecordDeserializationSchema<RowData> {
    public static final RowType TYPE = RowType.of(
            new LogicalType[] {
                new VarBinaryType(VarBinaryType.MAX_LENGTH), new VarBinaryType(VarBinaryType.MAX_LENGTH),
                new VarCharType(VarCharType.MAX_LENGTH), new IntType(), new BigIntType()
            },
            new String[] {"kafka_key", "payload", "source_topic", "source_partition", "source_offset"});

    @Override
    public void deserialize(ConsumerRecord<byte[], byte[]> record, Collector<RowData> out) {
        out.collect(GenericRowData.of(record.key(), record.value(), StringData.fromString(record.topic()),
                record.partition(), record.offset()));
    }

    @Override
    public TypeInformation<RowData> getProducedType() {
        return InternalTypeInfo.of(TYPE);
    }
}
