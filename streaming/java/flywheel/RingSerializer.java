package flywheel;

import java.io.IOException;

import org.apache.flink.api.common.typeutils.SimpleTypeSerializerSnapshot;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.api.common.typeutils.TypeSerializerSnapshot;
import org.apache.flink.api.common.typeutils.base.TypeSerializerSingleton;
import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataOutputView;
import org.apache.flink.types.StringValue;

/**
 * {@link LongHistory.Ring} in checkpoints: the settings, the names its codes stand for, each kept behavior
 * (item, category code, type code) oldest first, and the emitted row. What can be derived (counts and
 * newest behavior per category, the links between a category's behaviors) is rebuilt on restore.
 */
public final class RingSerializer extends TypeSerializerSingleton<LongHistory.Ring> {

    private static final int VERSION = 1;

    @Override
    public boolean isImmutableType() {
        return false;
    }

    @Override
    public LongHistory.Ring createInstance() {
        return new LongHistory.Ring();
    }

    @Override
    public LongHistory.Ring copy(LongHistory.Ring from) {
        LongHistory.Ring to = new LongHistory.Ring();
        to.capacity = from.capacity;
        to.topCategories = from.topCategories;
        to.perCategory = from.perCategory;
        to.first = from.first;
        to.next = from.next;
        to.items = from.items.clone();
        to.categories = from.categories.clone();
        to.types = from.types.clone();
        to.previous = from.previous.clone();
        to.names.addAll(from.names);
        to.codes.putAll(from.codes);
        to.counts = from.counts.clone();
        to.newestOf = from.newestOf.clone();
        to.newest = from.newest;
        to.pending = from.pending;
        to.rowTime = from.rowTime;
        to.rowLength = from.rowLength;
        to.rowCategories = from.rowCategories;  // the row's arrays are never changed, only replaced
        to.rowCounts = from.rowCounts;
        to.rowItems = from.rowItems;
        to.rowTypes = from.rowTypes;
        to.row = from.row;
        return to;
    }

    @Override
    public LongHistory.Ring copy(LongHistory.Ring from, LongHistory.Ring reuse) {
        return copy(from);
    }

    @Override
    public int getLength() {
        return -1;
    }

    @Override
    public void serialize(LongHistory.Ring ring, DataOutputView out) throws IOException {
        out.writeInt(VERSION);
        out.writeInt(ring.capacity);
        out.writeInt(ring.topCategories);
        out.writeInt(ring.perCategory);
        out.writeLong(ring.newest);
        out.writeInt(ring.pending);
        out.writeInt(ring.names.size());
        for (String name : ring.names) {
            StringValue.writeString(name, out);
        }
        out.writeInt(ring.items.length);
        out.writeInt(ring.size());
        for (long n = ring.first; n < ring.next; n++) {
            int slot = ring.slot(n);
            StringValue.writeString(ring.items[slot], out);
            out.writeInt(ring.categories[slot]);
            out.writeInt(ring.types[slot]);
        }
        out.writeLong(ring.rowTime);
        out.writeLong(ring.rowLength);
        writeStrings(ring.rowCategories, out);
        out.writeInt(ring.rowCounts.length);
        for (long count : ring.rowCounts) {
            out.writeLong(count);
        }
        writeStrings(ring.rowItems, out);
        writeStrings(ring.rowTypes, out);
    }

    @Override
    public LongHistory.Ring deserialize(DataInputView in) throws IOException {
        int version = in.readInt();
        if (version != VERSION) {
            throw new IOException("long history state of version " + version + "; this job reads " + VERSION);
        }
        LongHistory.Ring ring = new LongHistory.Ring();
        ring.capacity = in.readInt();
        ring.topCategories = in.readInt();
        ring.perCategory = in.readInt();
        ring.newest = in.readLong();
        ring.pending = in.readInt();
        int names = in.readInt();
        for (int c = 0; c < names; c++) {
            ring.code(StringValue.readString(in));
        }
        int length = in.readInt();
        int size = in.readInt();
        ring.items = new String[length];
        ring.categories = new int[length];
        ring.types = new int[length];
        ring.previous = new long[length];
        for (int n = 0; n < size; n++) {  // numbered afresh from 0, oldest first
            String item = StringValue.readString(in);
            int c = in.readInt();
            ring.items[n] = item;
            ring.categories[n] = c;
            ring.types[n] = in.readInt();
            ring.previous[n] = ring.newestOf[c];
            ring.newestOf[c] = n;
            ring.counts[c]++;
        }
        ring.next = size;
        ring.rowTime = in.readLong();
        ring.rowLength = in.readLong();
        ring.rowCategories = readStrings(in);
        ring.rowCounts = new long[in.readInt()];
        for (int k = 0; k < ring.rowCounts.length; k++) {
            ring.rowCounts[k] = in.readLong();
        }
        ring.rowItems = readStrings(in);
        ring.rowTypes = readStrings(in);
        return ring;
    }

    @Override
    public LongHistory.Ring deserialize(LongHistory.Ring reuse, DataInputView in) throws IOException {
        return deserialize(in);
    }

    @Override
    public void copy(DataInputView source, DataOutputView target) throws IOException {
        serialize(deserialize(source), target);
    }

    private static void writeStrings(String[] values, DataOutputView out) throws IOException {
        out.writeInt(values.length);
        for (String value : values) {
            StringValue.writeString(value, out);
        }
    }

    private static String[] readStrings(DataInputView in) throws IOException {
        String[] values = new String[in.readInt()];
        for (int i = 0; i < values.length; i++) {
            values[i] = StringValue.readString(in);
        }
        return values;
    }

    @Override
    public TypeSerializerSnapshot<LongHistory.Ring> snapshotConfiguration() {
        return new RingSnapshot();
    }

    /** The serializer's snapshot in checkpoints: restores with this class. */
    public static final class RingSnapshot extends SimpleTypeSerializerSnapshot<LongHistory.Ring> {
        public RingSnapshot() {
            super(RingSerializer::new);
        }
    }
}
